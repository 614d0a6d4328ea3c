"""Prefetch policies in the scheduler core: ask-later while a promotion runs, what
counts once admitted, and the timeliness counters. The store here is a dict of
key -> tier whose promotion the test finishes by hand; the real service path is in
test_service.py and the vLLM end-to-end tests."""

from __future__ import annotations

import pytest

from engine_plugin.vllm.core.groups import KVGeometry
from engine_plugin.vllm.core.options import parse_options
from engine_plugin.vllm.core.prefetch import PrefetchPolicy, PrefetchTracker, Residency
from engine_plugin.vllm.core.scheduler_side import SchedulerCore, SchedulerSettings
from kvstore.format.errors import ConfigError
from kvstore.format.keys import KVNamespace, chunk_keys
from kvstore.tiers.return_rates import RequestEnd

CHUNK, BLOCK = 256, 128
NAMESPACE = KVNamespace("m", "float16", "cpu", CHUNK)
PROMPT = list(range(7, 7 + 8 * CHUNK + 1))  # 8 full chunks and one more token


class FakeStore:
    def __init__(self, on_disk: int, in_dram: int = 0) -> None:
        keys = chunk_keys(PROMPT, NAMESPACE)
        self.tier = {k: "dram" for k in keys[:in_dram]} | {k: "disk" for k in keys[in_dram:on_disk]}
        self.pending: set[tuple[bytes, ...]] = set()
        self.prefetches: list[int] = []
        self.told: list[tuple[str, int]] = []
        self.ends: list[RequestEnd | None] = []

    def notify(self, kind: str, ranks: list[list[bytes]], in_s: float, end: RequestEnd | None = None) -> None:
        self.told.append((kind, len(ranks[0])))
        self.ends.append(end)

    def lookup(self, ranks: list[list[bytes]], prefetch: bool, lease: bool = False) -> Residency:
        (keys,) = ranks  # one tensor-parallel rank
        run = []
        for key in keys:
            if key not in self.tier:
                break
            run.append(key)
        if prefetch:
            self.prefetches.append(len(run))
            if any(self.tier[k] == "disk" for k in run):
                self.pending.add(tuple(run))
        resident = next((i for i, k in enumerate(run) if self.tier[k] != "dram"), len(run))
        return Residency(len(run), resident, tuple(run) in self.pending)

    def finish_promotion(self, chunks: int | None = None) -> None:
        for run in self.pending:
            for key in run[:chunks]:
                self.tier[key] = "dram"
        self.pending.clear()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scheduler(store: FakeStore, policy: str, clock: Clock, **kwargs) -> SchedulerCore:
    core = SchedulerCore(KVGeometry(CHUNK, BLOCK), lambda salt: (NAMESPACE,), store.lookup,
                         SchedulerSettings(prefetch=PrefetchPolicy(policy, **kwargs)), clock=clock,
                         notify=store.notify)
    assert core.prefetch is not None
    return core


def test_wait_holds_the_request_until_its_promotion_finishes():
    store, clock = FakeStore(on_disk=8), Clock()
    core = scheduler(store, "wait", clock)
    core.on_arrival("r", PROMPT)
    assert store.prefetches == [8]  # the arrival started the promotion
    assert core.num_new_matched_tokens("r", PROMPT, 0) is None  # ask again later
    clock.now += 0.3
    assert core.num_new_matched_tokens("r", PROMPT, 0) is None
    assert store.prefetches == [8]  # asking again does not queue another promotion
    store.finish_promotion()
    clock.now += 0.2
    assert core.num_new_matched_tokens("r", PROMPT, 0) == 8 * CHUNK
    counters = core.prefetch.take_counters()
    assert counters == {"prefetch.requests": 1, "prefetch.disk_chunks": 8, "prefetch.resident_chunks": 8,
                        "prefetch.late_requests": 1, "prefetch.late_ms": 500}


def test_a_promotion_done_before_the_scheduler_asks_is_ready():
    store, clock = FakeStore(on_disk=8, in_dram=2), Clock()
    core = scheduler(store, "wait", clock)
    core.on_arrival("r", PROMPT)
    store.finish_promotion()
    assert core.num_new_matched_tokens("r", PROMPT, 0) == 8 * CHUNK
    assert core.prefetch.take_counters() == {
        "prefetch.requests": 1, "prefetch.disk_chunks": 6, "prefetch.resident_chunks": 6,
        "prefetch.ready_requests": 1}


def test_wait_gives_up_after_max_wait_and_loads_everything_stored():
    store, clock = FakeStore(on_disk=8), Clock()
    core = scheduler(store, "wait", clock, max_wait_s=2.0)
    core.on_arrival("r", PROMPT)
    assert core.num_new_matched_tokens("r", PROMPT, 0) is None
    clock.now += 2.5  # the promotion is stuck (a slow device)
    assert core.num_new_matched_tokens("r", PROMPT, 0) == 8 * CHUNK  # read from disk at load
    counters = core.prefetch.take_counters()
    assert counters["prefetch.resident_chunks"] == 0 and counters["prefetch.late_ms"] == 2500


def test_a_promotion_that_ends_short_does_not_hold_the_request():
    """DRAM too small for the whole run: the promotion finishes with part of it; wait
    loads the rest from disk instead of waiting for chunks that will never come."""
    store, clock = FakeStore(on_disk=8), Clock()
    core = scheduler(store, "wait", clock)
    core.on_arrival("r", PROMPT)
    store.finish_promotion(chunks=5)
    assert core.num_new_matched_tokens("r", PROMPT, 0) == 8 * CHUNK
    assert core.prefetch.take_counters()["prefetch.resident_chunks"] == 5


def test_timeout_budget_scales_with_the_prompt_and_then_counts_only_dram():
    store, clock = FakeStore(on_disk=8, in_dram=3), Clock()
    core = scheduler(store, "timeout", clock, timeout_s_per_1k_tokens=0.1)
    core.on_arrival("r", PROMPT)  # 2,049 tokens: a 0.2049 s budget
    assert core.num_new_matched_tokens("r", PROMPT, 0) is None
    clock.now += 0.15
    assert core.num_new_matched_tokens("r", PROMPT, 0) is None
    clock.now += 0.1
    assert core.num_new_matched_tokens("r", PROMPT, 0) == 3 * CHUNK  # the disk part is recomputed
    # ... and not saved again: it is stored already.
    core.on_alloc("r", list(range(len(PROMPT) // BLOCK + 1)), 3 * CHUNK)
    core.on_scheduled("r", None, False, len(PROMPT))
    assert core.take_plan().saves == []


def test_best_effort_never_waits():
    store, clock = FakeStore(on_disk=8, in_dram=4), Clock()
    core = scheduler(store, "best_effort", clock)
    core.on_arrival("r", PROMPT)
    assert core.num_new_matched_tokens("r", PROMPT, 0) == 4 * CHUNK
    counters = core.prefetch.take_counters()
    assert counters["prefetch.late_requests"] == 1 and counters["prefetch.resident_chunks"] == 0


def test_a_request_without_arrival_starts_its_promotion_at_the_first_ask():
    store, clock = FakeStore(on_disk=8), Clock()
    core = scheduler(store, "wait", clock)
    assert core.num_new_matched_tokens("r", PROMPT, 0) is None
    assert store.prefetches == [8]


def test_hints_and_finished_requests_keep_chunks_warm():
    store, clock = FakeStore(on_disk=8), Clock()
    core = scheduler(store, "wait", clock)
    core.hint(PROMPT[: 4 * CHUNK])
    assert store.prefetches == [4]
    store.finish_promotion()
    core.on_arrival("r", PROMPT)
    store.finish_promotion()
    assert core.num_new_matched_tokens("r", PROMPT, 0) == 8 * CHUNK
    core.on_finished("r")
    assert store.prefetches == [4, 8]  # a finish is not a lookup: the service is told instead
    assert store.told == [("finished", 8)]  # its chunks, for the next-turn prediction


def test_a_finished_request_says_how_it_ended_and_its_next_turn_continues_it():
    """The first request ends with a 100-token answer: turn 0, a new chain. Its next turn (its
    prompt, the answer, a new message) arrives 42 s after it ended: turn 1, idle 42 s. An
    unrelated prompt is a new chain again."""
    store, clock = FakeStore(on_disk=8, in_dram=8), Clock()
    core = scheduler(store, "best_effort", clock)
    tokens = list(PROMPT)
    assert core.num_new_matched_tokens("a", tokens, 0) == 8 * CHUNK
    tokens += range(100)  # the engine's token list grows with the answer
    clock.now += 3
    core.on_finished("a")
    assert store.ends == [RequestEnd(answer_tokens=100, turn=0, idle_s=None)]
    clock.now += 42
    follow_up = [*tokens, *range(500, 600)]
    assert core.num_new_matched_tokens("b", follow_up, 0) == 8 * CHUNK
    core.on_finished("b")
    assert store.ends[-1] == RequestEnd(answer_tokens=0, turn=1, idle_s=42.0)
    other = [9, *PROMPT[1:]]
    store.tier.update(dict.fromkeys(chunk_keys(other, NAMESPACE), "dram"))
    assert core.num_new_matched_tokens("c", other, 0) == 8 * CHUNK
    core.on_finished("c")
    assert store.ends[-1] == RequestEnd(answer_tokens=0, turn=0, idle_s=None)

def test_options_parse_and_reject_bad_policies():
    options = parse_options({"config": {"tiers": {"dram": {"capacity": "1GiB"}}},
                             "prefetch_policy": "timeout", "prefetch_timeout_s_per_1k_tokens": 0.2})
    assert options.prefetch == PrefetchPolicy("timeout", timeout_s_per_1k_tokens=0.2)
    assert parse_options({"config": {"tiers": {"dram": {"capacity": "1GiB"}}},
                          "prefetch": False}).prefetch is None
    with pytest.raises(ConfigError, match=r"prefetch_policy.*best_effort, wait, timeout"):
        parse_options({"config": {"tiers": {"dram": {"capacity": "1GiB"}}}, "prefetch_policy": "eager"})
    with pytest.raises(ConfigError, match="prefetch_max_wait_s"):
        PrefetchPolicy(max_wait_s=-1)


def test_tracker_takes_the_residency_every_rank_has():
    combined = Residency(6, 2, True)  # rank 0: 8 stored, 8 in DRAM; rank 1: 6 stored, 2 in DRAM
    tracker = PrefetchTracker(PrefetchPolicy("best_effort"))
    assert tracker.decide("x", combined, 100) == 2


def test_a_preempted_request_asked_again_is_counted_once():
    store, clock = FakeStore(on_disk=8), Clock()
    core = scheduler(store, "best_effort", clock)
    core.on_arrival("r", PROMPT)
    assert core.num_new_matched_tokens("r", PROMPT, 0) == 0
    store.finish_promotion()
    assert core.num_new_matched_tokens("r", PROMPT, 0) == 8 * CHUNK  # re-admitted after preemption
    assert core.prefetch.take_counters()["prefetch.requests"] == 1
    core.on_finished("r")  # forgotten: the same id arriving again is a new request
    store.tier = dict.fromkeys(store.tier, "disk")  # (say DRAM was emptied meanwhile)
    core.on_arrival("r", PROMPT)
    core.num_new_matched_tokens("r", PROMPT, 0)
    assert core.prefetch.take_counters()["prefetch.requests"] == 1
