"""The engine-agnostic connector core: what to load, what to save, and when."""

from __future__ import annotations

import dataclasses

import pytest

from engine_plugin.vllm.core.groups import KVGeometry
from engine_plugin.vllm.core.leases import Released
from engine_plugin.vllm.core.options import check_chunk_size, parse_options
from engine_plugin.vllm.core.plan import SKIP
from engine_plugin.vllm.core.prefetch import Residency
from engine_plugin.vllm.core.scheduler_side import Keying, SchedulerCore, SchedulerSettings
from kvstore.format.errors import ConfigError
from kvstore.format.keys import (
    KeyExtras,
    KVNamespace,
    Placeholder,
    Shard,
    TensorParallel,
    Weights,
    chunk_keys,
)

CHUNK, BLOCK = 256, 128
GEOMETRY = KVGeometry(CHUNK, BLOCK)
NAMESPACES = (KVNamespace("m", "float16", "cpu", CHUNK, Shard(TensorParallel(0, 2))),
              KVNamespace("m", "float16", "cpu", CHUNK, Shard(TensorParallel(1, 2))))


def core(stored: dict[bytes, bool] | None = None, load_async: bool = True,
         settings: SchedulerSettings | None = None) -> SchedulerCore:
    """A scheduler over a store holding `stored` (all in DRAM), prefetch off."""
    return SchedulerCore(GEOMETRY, lambda salt: NAMESPACES, lookup_in(stored or {}),
                         settings or SchedulerSettings(load_async))


def lookup_in(present: dict[bytes, bool]):  # -> Lookup
    def lookup(ranks: list[list[bytes]], prefetch: bool, lease_from: int | None = None) -> Residency:
        count = min(next((i for i, key in enumerate(keys) if key not in present), len(keys))
                    for keys in ranks)
        return Residency(count, count)

    return lookup


def store_chunks(tokens: list[int], chunks: int, ranks: tuple[int, ...] = (0, 1)) -> dict[bytes, bool]:
    return {key: True for rank in ranks for key in chunk_keys(tokens, NAMESPACES[rank])[:chunks]}


PROMPT = list(range(3, 3 + 2049))


def test_a_full_hit_leaves_one_token_to_compute():
    scheduler = core(store_chunks(PROMPT, 8))
    assert scheduler.num_new_matched_tokens("r", PROMPT, 0) == 2048
    exact = PROMPT[:2048]  # a prompt of exactly 8 chunks: the last one must be computed
    assert scheduler.num_new_matched_tokens("e", exact, 0) == 7 * CHUNK


def test_a_hit_is_split_by_the_tier_that_held_it_at_the_lookup():
    def lookup(ranks: list[list[bytes]], prefetch: bool, lease_from: int | None = None) -> Residency:
        return Residency(stored=6, resident=2)  # chunks 0-1 in DRAM, 2-5 on disk

    scheduler = SchedulerCore(GEOMETRY, lambda salt: NAMESPACES, lookup, SchedulerSettings(True))
    assert scheduler.num_new_matched_tokens("r", PROMPT, 384) == 6 * CHUNK - 384
    assert scheduler.hit_sources("r", 6 * CHUNK - 384) == {"dram": 2 * CHUNK - 384, "disk": 4 * CHUNK}
    assert scheduler.hit_sources("r", 3 * CHUNK) == {"disk": 3 * CHUNK}  # the engine trimmed its own hit
    assert scheduler.hit_sources("r", 0) == {} and scheduler.hit_sources("unknown", 256) == {}


def test_every_rank_must_hold_a_chunk():
    stored = store_chunks(PROMPT, 8, ranks=(0,)) | store_chunks(PROMPT, 3, ranks=(1,))
    assert core(stored).num_new_matched_tokens("r", PROMPT, 0) == 3 * CHUNK


def test_load_skips_blocks_the_engine_already_holds():
    scheduler = core(store_chunks(PROMPT, 4))
    # The engine's prefix cache holds 384 tokens (3 blocks): chunk 1's first block is its own.
    assert scheduler.num_new_matched_tokens("r", PROMPT, 384) == 1024 - 384
    blocks = list(range(100, 117))
    scheduler.on_alloc("r", blocks, 1024 - 384)
    plan = scheduler.take_plan()
    (load,) = plan.loads
    assert load.blocks == ((SKIP, 103), (104, 105), (106, 107))
    assert load.keys[1] == tuple(chunk_keys(PROMPT, NAMESPACES[1])[1:4])
    assert load.parents[0] == chunk_keys(PROMPT, NAMESPACES[0])[0]
    assert scheduler.take_plan().loads == []  # a plan is handed out once


def test_chunked_prefill_saves_each_chunk_once_when_complete():
    scheduler = core()
    assert scheduler.num_new_matched_tokens("r", PROMPT, 0) == 0
    blocks = list(range(17))
    scheduler.on_scheduled("r", blocks[:3], replace=True, computed_after_step=300)
    scheduler.on_scheduled("r", blocks[3:6], replace=False, computed_after_step=700)
    scheduler.on_scheduled("r", None, replace=False, computed_after_step=700)
    scheduler.on_scheduled("r", blocks[6:], replace=False, computed_after_step=2049)
    scheduler.on_scheduled("r", None, replace=False, computed_after_step=2060)  # decode: no prompt chunks
    saves = scheduler.take_plan().saves
    assert [(s.keys[0][0], s.num_chunks) for s in saves] == [
        (chunk_keys(PROMPT, NAMESPACES[0])[0], 1),
        (chunk_keys(PROMPT, NAMESPACES[0])[1], 1),
        (chunk_keys(PROMPT, NAMESPACES[0])[2], 6),
    ]
    assert saves[2].blocks[0] == (4, 5) and saves[2].parents[0] == chunk_keys(PROMPT, NAMESPACES[0])[1]
    assert all(s.namespaces == (NAMESPACES[0].digest(), NAMESPACES[1].digest()) for s in saves)


def test_chunks_generated_tokens_fill_are_saved_under_the_keys_of_the_whole_sequence():
    """The next turn's prompt is this prompt + the answer + more: its keys hash the
    answer's tokens, so the answer's chunks are saved as decoding completes each."""
    tokens = list(PROMPT)  # the engine's live list: decoding appends to it
    scheduler = core()
    scheduler.num_new_matched_tokens("r", tokens, 0)
    scheduler.on_scheduled("r", list(range(17)), replace=True, computed_after_step=2049)
    answer = list(range(600, 600 + 300))
    for step, token in enumerate(answer):  # one token per step; its KV is written the step after
        tokens.append(token)
        new_block = [(2049 + step) // BLOCK] if (2049 + step) % BLOCK == 0 else None
        scheduler.on_scheduled("r", new_block, replace=False, computed_after_step=2049 + step + 1)
    saves = scheduler.take_plan().saves
    whole = chunk_keys(PROMPT + answer, NAMESPACES[0])
    assert [s.keys[0] for s in saves] == [tuple(whole[:8]), (whole[8],)]
    assert saves[1].parents[0] == whole[7] and saves[1].blocks == ((16, 17),)
    assert saves[1].keys[1] == (chunk_keys(PROMPT + answer, NAMESPACES[1])[8],)


def test_an_image_is_in_the_keys_of_prompt_and_answer_chunks_and_handoffs():
    """An image at the prompt's end: the chunks it overlaps (the last one filled by the
    answer) and every later one are keyed with it; chunks before it are text keys."""
    image = KeyExtras((Placeholder("img-a", 2000, 100),))
    tokens = list(PROMPT)
    scheduler = core()
    scheduler.num_new_matched_tokens("r", tokens, 0, Keying(extras=image))
    scheduler.on_scheduled("r", list(range(17)), replace=True, computed_after_step=2049)
    answer = list(range(600, 600 + 300))
    tokens += answer
    scheduler.on_scheduled("r", [16, 17, 18], replace=False, computed_after_step=len(tokens))
    saves = scheduler.take_plan().saves
    keyed, text = chunk_keys(tokens, NAMESPACES[0], extras=image), chunk_keys(tokens, NAMESPACES[0])
    assert [k for s in saves for k in s.keys[0]] == keyed[:9]
    assert keyed[:7] == text[:7] and not set(keyed[7:]) & set(text)
    handoff = scheduler.handoff("r", len(PROMPT))
    assert handoff is not None and handoff.last_key == keyed[7]


def test_a_new_generation_keys_new_lookups_and_leaves_running_requests_in_theirs():
    """After a weight update the engine's namespaces move on: a request that was running
    keeps saving its answer on its old chains (its KV is the old weights'), a new one is
    keyed in the new namespaces, and keys computed at arrival are not reused."""
    current = {"namespaces": NAMESPACES}
    scheduler = SchedulerCore(GEOMETRY, lambda salt: current["namespaces"], lookup_in({}),
                              SchedulerSettings(True, stage_on_arrival=True))
    tokens = list(PROMPT)
    scheduler.num_new_matched_tokens("running", tokens, 0)
    scheduler.on_scheduled("running", list(range(17)), replace=True, computed_after_step=2049)
    scheduler.on_arrival("waiting", PROMPT)
    current["namespaces"] = tuple(dataclasses.replace(ns, weights=Weights("", "9f01")) for ns in NAMESPACES)
    scheduler.forget_lookups()
    tokens += range(600, 900)
    scheduler.on_scheduled("running", [16, 17, 18], replace=False, computed_after_step=len(tokens))
    scheduler.num_new_matched_tokens("waiting", PROMPT, 0)
    scheduler.on_scheduled("waiting", list(range(17)), replace=True, computed_after_step=2049)
    saves = scheduler.take_plan().saves
    answer = [s for s in saves if s.req_id == "running"][-1]
    assert answer.keys[0] == (chunk_keys(tokens, NAMESPACES[0])[8],)
    assert answer.namespaces == (NAMESPACES[0].digest(), NAMESPACES[1].digest())
    (fresh,) = [s for s in saves if s.req_id == "waiting"]
    assert fresh.keys[0] == tuple(chunk_keys(PROMPT, current["namespaces"][0])[:8])
    assert fresh.namespaces == tuple(ns.digest() for ns in current["namespaces"])


def test_answers_are_not_saved_when_the_option_is_off():
    tokens = list(PROMPT)
    scheduler = core(settings=SchedulerSettings(saves="prompts"))
    scheduler.num_new_matched_tokens("r", tokens, 0)
    scheduler.on_scheduled("r", list(range(17)), replace=True, computed_after_step=2049)
    tokens += range(600, 900)
    scheduler.on_scheduled("r", list(range(17, 20)), replace=False, computed_after_step=2349)
    assert [s.num_chunks for s in scheduler.take_plan().saves] == [8]


def test_chunks_already_stored_are_not_saved_again():
    scheduler = core(store_chunks(PROMPT, 5))
    scheduler.num_new_matched_tokens("r", PROMPT, 0)
    scheduler.on_scheduled("r", list(range(17)), replace=True, computed_after_step=2049)
    (save,) = scheduler.take_plan().saves
    assert save.keys[0] == tuple(chunk_keys(PROMPT, NAMESPACES[0])[5:8])


def test_a_salt_changes_every_key():
    salted = KVNamespace("m", "float16", "cpu", CHUNK, salt="lora-a|")
    assert not set(chunk_keys(PROMPT, salted)) & set(chunk_keys(PROMPT, NAMESPACES[0]))


def test_options_name_the_bad_field():
    with pytest.raises(ConfigError, match="'chunk_tokens'"):
        check_chunk_size(100, 128)
    assert check_chunk_size(256, 128) == 2
    with pytest.raises(ConfigError, match="'load_async'"):
        parse_options({"config": {"tiers": {"dram": {"capacity": "1GiB"}}}, "load_async": "yes"})
    with pytest.raises(ConfigError, match=r"'tiers\.ssd'"):
        parse_options({"config": {"tiers": {"ssd": {}}}})
    with pytest.raises(ConfigError, match="'config'"):
        parse_options({})
    inline = parse_options({"tiers": {"dram": {"capacity": "1GiB"}}, "load_async": False})
    assert inline.store.dram is not None and inline.load_async is False
    old = parse_options({"config": {"tiers": {"host": {"capacity": "1GiB"}}}})  # the DRAM tier's old key
    assert old.store.dram is not None and old.store == inline.store


@pytest.mark.parametrize("extra,field,words", [
    ({"prefetch": 1}, "prefetch", "true or false"),
    ({"prefetch_max_wait_s": True}, "prefetch_max_wait_s", "seconds"),
    ({"prefetch_timeout_s_per_1k_tokens": -0.5}, "prefetch_timeout_s_per_1k_tokens", "at least 0"),
    ({"device_staging": "lots"}, "device_staging", "not a size"),
    ({"model_id": ""}, "model_id", "non-empty"),
    ({"loadAsync": True}, "loadAsync", "allowed: config, device_staging, load_async"),
])
def test_engine_keys_name_the_bad_field(extra, field, words):
    with pytest.raises(ConfigError) as caught:
        parse_options({"config": {"tiers": {"dram": {"capacity": "1GiB"}}}, **extra})
    assert caught.value.field == field and words in caught.value.reason


def test_store_keys_at_the_top_level_are_checked_as_store_keys():
    options = parse_options({"tiers": {"dram": {"capacity": "1GiB"}}, "chunk_tokens": 128,
                             "device_staging": "64MiB", "model_id": "m"})
    assert (options.store.chunk_tokens, options.device_staging, options.model_id) == (128, 64 << 20, "m")
    with pytest.raises(ConfigError) as caught:
        parse_options({"tiers": {"dram": {"capacity": "1GiB"}}, "loadAsync": True})
    assert caught.value.field == "loadAsync" and "chunk_tokens" in caught.value.reason


@pytest.mark.parametrize("resident,computed,sync_dram_loads,expect_async", [
    (8, 0, True, False),  # leased whole: a copy, loaded in its step
    (8, 3 * CHUNK, True, False),  # the engine holds three chunks: only the rest leased, whole
    (6, 0, True, True),  # two chunks on disk: I/O, loaded while the request waits
    (8, 0, False, True),  # the option off: as load_async says
])
def test_a_hit_leased_whole_in_dram_loads_in_its_step(resident, computed, sync_dram_loads, expect_async):
    """The lookup that decides the load leased the DRAM run past what the engine's own cache
    holds; a hit it covers whole is told to the engine as a sync load (no extra engine step),
    its plan's transfer says so and its lease goes back after the step; any other hit stays
    async until its load ends."""
    asked: list[int | None] = []

    def lookup(ranks: list[list[bytes]], prefetch: bool, lease_from: int | None = None) -> Residency:
        asked.append(lease_from)
        if lease_from is None:
            return Residency(8, resident)
        leased = tuple(i * 4096 if lease_from <= i < resident else -1 for i in range(8))
        offsets = tuple(leased for _ in ranks)
        return Residency(8, resident, lease=5, offsets=offsets)

    scheduler = SchedulerCore(GEOMETRY, lambda salt: NAMESPACES, lookup,
                              SchedulerSettings(load_async=True, sync_dram_loads=sync_dram_loads))
    assert scheduler.num_new_matched_tokens("r", PROMPT, computed) == 8 * CHUNK - computed
    assert asked == [computed // CHUNK]  # no lease for the chunks the engine holds
    assert scheduler.loads_async("r") is expect_async
    scheduler.on_alloc("r", list(range(16)), 8 * CHUNK - computed)
    plan = scheduler.take_plan()
    (load,) = plan.loads
    assert load.load_async is expect_async
    assert load.leased[0][: resident - computed // CHUNK] == tuple(range(computed // CHUNK * 4096,
                                                                           resident * 4096, 4096))
    scheduler.step_done([], steps=[] if expect_async else [plan.step])  # one rank of two carried it out
    assert scheduler.take_releases() == Released(read=[], unread=[])
    scheduler.step_done([], steps=[] if expect_async else [plan.step])  # and the other
    assert scheduler.take_releases() == Released(read=[] if expect_async else [5], unread=[])
    scheduler.step_done(["r"])  # the async load ended
    assert scheduler.take_releases() == Released(read=[5] if expect_async else [], unread=[])


def test_a_lease_given_back_with_no_load_carried_out_from_it_is_unread():
    """A request asked again while it waits for blocks (each step, under memory pressure),
    given blocks with nothing to load, or whose load failed, gives its lease back unread:
    the service counts no get for it, so a waiting request is not a hit at every step; a
    load's lease is read."""
    leases = iter(range(1, 10))

    def lookup(ranks: list[list[bytes]], prefetch: bool, lease_from: int | None = None) -> Residency:
        offsets = tuple(i * 4096 for i in range(8))
        return Residency(8, 8, lease=next(leases), offsets=tuple(offsets for _ in ranks))

    scheduler = SchedulerCore(GEOMETRY, lambda salt: NAMESPACES, lookup,
                              SchedulerSettings(load_async=True, sync_dram_loads=False))
    for _ in range(3):  # waiting: asked again at each step
        assert scheduler.num_new_matched_tokens("r", PROMPT, 0) == 8 * CHUNK
    assert scheduler.take_releases() == Released(read=[], unread=[1, 2])
    scheduler.on_alloc("r", list(range(16)), 0)  # blocks, and the engine loads nothing
    assert scheduler.take_releases() == Released(read=[], unread=[3])
    assert scheduler.num_new_matched_tokens("s", PROMPT, 0) == 8 * CHUNK
    scheduler.on_alloc("s", list(range(16)), 8 * CHUNK)
    assert scheduler.take_plan().loads
    scheduler.on_finished("s")  # finished while its async load runs: read once that ends
    scheduler.step_done(["s"])
    assert scheduler.take_releases() == Released(read=[4], unread=[])
    assert scheduler.num_new_matched_tokens("t", PROMPT, 0) == 8 * CHUNK
    scheduler.on_alloc("t", list(range(16)), 8 * CHUNK)
    assert scheduler.take_plan().loads
    scheduler.step_done([], failed=["t"])  # vLLM reports it failed (by request)
    assert scheduler.take_releases() == Released(read=[], unread=[5])
    assert scheduler.num_new_matched_tokens("u", PROMPT, 0) == 8 * CHUNK
    scheduler.on_alloc("u", list(range(16, 32)), 8 * CHUNK)
    assert scheduler.take_plan().loads
    scheduler.step_done(["u"], failed_blocks=[20])  # one KV cache group: vLLM reports by block
    assert scheduler.take_releases() == Released(read=[], unread=[6])


@pytest.mark.parametrize("sync_dram_loads", [False, True])
@pytest.mark.parametrize("shipped", [False, True])
def test_a_fault_gives_a_load_up_only_before_the_workers_have_it(shipped, sync_dram_loads):
    """A request abandoned after a fault: a load still in the step's plan is given up (its
    lease goes back unread); one the workers already have still copies from the lease,
    which goes back read once that load ends, never earlier."""
    scheduler = _leasing_core(sync_dram_loads)
    assert scheduler.num_new_matched_tokens("r", PROMPT, 0) == 8 * CHUNK
    scheduler.on_alloc("r", list(range(16)), 8 * CHUNK)
    plan = scheduler.take_plan() if shipped else None
    scheduler.abandon("r")
    plan = plan or scheduler.take_plan()
    (load,) = plan.loads
    assert bool(load.keys) is shipped  # given up: no keys, the workers report its blocks failed
    assert scheduler.take_releases() == Released(read=[], unread=[])  # the workers may be copying
    scheduler.step_done(["r"] if load.load_async else [], steps=[] if load.load_async else [plan.step] * 2)
    assert scheduler.take_releases() == Released(read=[7] if shipped else [], unread=[] if shipped else [7])


def _leasing_core(sync_dram_loads: bool = False) -> SchedulerCore:
    """A scheduler over two ranks whose every lookup finds 8 chunks in DRAM and leases
    them (lease numbers 7, 8, ...)."""
    leases = iter(range(7, 100))

    def lookup(ranks: list[list[bytes]], prefetch: bool, lease_from: int | None = None) -> Residency:
        offsets = tuple(i * 4096 if i >= (lease_from or 0) else -1 for i in range(8))
        return Residency(8, 8, lease=next(leases), offsets=tuple(offsets for _ in ranks))

    return SchedulerCore(GEOMETRY, lambda salt: NAMESPACES, lookup,
                         SchedulerSettings(load_async=True, sync_dram_loads=sync_dram_loads))


def test_a_sync_loads_lease_goes_once_every_worker_reported_its_plan():
    """Under vLLM's async scheduling the next step is planned before a step is reported:
    a sync load's lease goes when both ranks report the plan that shipped it, not with
    the report of the step before."""
    scheduler = _leasing_core(sync_dram_loads=True)
    scheduler.num_new_matched_tokens("a", PROMPT, 0)
    scheduler.on_alloc("a", list(range(16)), 8 * CHUNK)
    first = scheduler.take_plan()  # step N
    scheduler.num_new_matched_tokens("b", PROMPT, 0)
    scheduler.on_alloc("b", list(range(100, 116)), 8 * CHUNK)
    second = scheduler.take_plan()  # step N + 1, planned before N is reported
    assert not first.loads[0].load_async and second.step == first.step + 1
    scheduler.step_done([], steps=[first.step, first.step])  # N's report (both ranks)
    assert scheduler.take_releases() == Released(read=[7], unread=[])
    scheduler.step_done([], steps=[second.step])  # one rank of N + 1
    assert scheduler.take_releases() == Released(read=[], unread=[])
    scheduler.step_done([], steps=[second.step])
    assert scheduler.take_releases() == Released(read=[8], unread=[])


def test_under_the_external_launcher_one_workers_report_is_all_there_is():
    """vLLM's external launcher (torchrun): each process schedules for its own worker, so
    one report ends a save or a sync load, where waiting for every rank's held the lease
    and the save for good."""
    leases = iter(range(7, 100))

    def lookup(ranks: list[list[bytes]], prefetch: bool, lease_from: int | None = None) -> Residency:
        offsets = tuple(i * 4096 for i in range(8))
        return Residency(8, 8, lease=next(leases), offsets=tuple(offsets for _ in ranks))

    scheduler = SchedulerCore(GEOMETRY, lambda salt: NAMESPACES, lookup,
                              SchedulerSettings(load_async=True, reporting_workers=1))
    assert scheduler.num_new_matched_tokens("r", PROMPT, 0) == 8 * CHUNK
    scheduler.on_alloc("r", list(range(16)), 8 * CHUNK)
    plan = scheduler.take_plan()
    assert not plan.loads[0].load_async
    scheduler.step_done([], steps=[plan.step])  # this process's worker: the only one
    assert scheduler.take_releases() == Released(read=[7], unread=[])


def test_a_failed_block_is_the_load_of_the_plan_it_ran_in():
    """Under async scheduling a request preempted after its sync load shipped frees its
    blocks before that plan is reported; a failed block in that report is its load's, not
    the next plan's load that took the block over."""
    scheduler = _leasing_core(sync_dram_loads=True)
    scheduler.num_new_matched_tokens("a", PROMPT, 0)
    scheduler.on_alloc("a", list(range(16)), 8 * CHUNK)
    first = scheduler.take_plan()
    scheduler.num_new_matched_tokens("a", PROMPT, 0)  # preempted: asked again (lease 8, held)
    scheduler.num_new_matched_tokens("b", PROMPT, 0)
    scheduler.on_alloc("b", [10, *range(100, 115)], 8 * CHUNK)  # b takes a's block 10
    second = scheduler.take_plan()
    scheduler.step_done([], failed_blocks=[10], steps=[first.step] * 2)
    assert scheduler.take_releases() == Released(read=[], unread=[7])
    scheduler.step_done([], steps=[second.step] * 2)
    assert scheduler.take_releases() == Released(read=[9], unread=[])


def test_a_failed_block_fails_only_the_load_that_writes_it_and_releases_nothing_early():
    """vLLM passes a rank's failed blocks on at once but an async load's end only once
    every rank has finished: a failed block marks the load that writes it (not a request
    that shares the block from the engine's own cache), whose lease goes at its end; a
    request forgotten before the report still has its failed load counted unread."""
    scheduler = _leasing_core()
    scheduler.num_new_matched_tokens("a", PROMPT, 0)
    scheduler.on_alloc("a", list(range(16)), 8 * CHUNK)
    scheduler.num_new_matched_tokens("b", PROMPT, CHUNK)  # b shares a's first chunk (blocks 0, 1)
    scheduler.on_alloc("b", [0, 1, *range(100, 114)], 7 * CHUNK)
    scheduler.take_plan()
    scheduler.step_done([], failed_blocks=[1])  # rank 0: a's block 1 failed; rank 1 still copies
    assert scheduler.take_releases() == Released(read=[], unread=[])
    scheduler.on_finished("a")  # aborted meanwhile
    scheduler.step_done(["a", "b"])  # every rank finished both
    assert scheduler.take_releases() == Released(read=[8], unread=[7])


def test_nothing_is_leased_where_the_engines_own_cache_covers_the_hit():
    asked: list[int | None] = []

    def lookup(ranks: list[list[bytes]], prefetch: bool, lease_from: int | None = None) -> Residency:
        asked.append(lease_from)
        return Residency(8, 8)

    scheduler = SchedulerCore(GEOMETRY, lambda salt: NAMESPACES, lookup, SchedulerSettings(True))
    assert scheduler.num_new_matched_tokens("r", PROMPT, 8 * CHUNK) == 0
    assert asked == [None]
