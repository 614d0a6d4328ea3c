"""Prefill/decode handoff in the connector core: roles, the params a producer returns,
and the consumer's bounded wait for exactly the chunks they name (engine_plugin/vllm/core/handoff.py)."""

from __future__ import annotations

import pytest

from engine_plugin.vllm.core.chain_reports import Notify
from engine_plugin.vllm.core.groups import KVGeometry
from engine_plugin.vllm.core.handoff import PARAMS_KEY, Handoff, Role, check_producer_store
from engine_plugin.vllm.core.prefetch import Residency
from engine_plugin.vllm.core.scheduler_side import SchedulerCore, SchedulerSettings
from kvstore.config.store import load_config
from kvstore.format.errors import ConfigError
from kvstore.format.keys import KVNamespace, Shard, TensorParallel, chunk_keys
from kvstore.format.malformed import Malformed

CHUNK, BLOCK = 256, 128
NAMESPACE = KVNamespace("m", "float16", "cpu", CHUNK)
PROMPT = list(range(3, 3 + 2049))  # 8 full chunks and one token
KEYS = chunk_keys(PROMPT, NAMESPACE)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def core(present: set[bytes], settings: SchedulerSettings, clock: Clock, ranks: int = 1,
         notify: Notify | None = None) -> SchedulerCore:
    def lookup(keys: list[list[bytes]], prefetch: bool, lease: bool = False) -> Residency:
        count = next((i for i, key in enumerate(keys[0]) if key not in present), len(keys[0]))
        return Residency(count, count)

    namespaces = tuple(KVNamespace("m", "float16", "cpu", CHUNK, Shard(TensorParallel(rank, ranks)))
                       for rank in range(ranks))
    return SchedulerCore(KVGeometry(CHUNK, BLOCK), lambda salt: namespaces, lookup, settings, clock=clock,
                         notify=notify)


def test_roles_follow_vllm_kv_role():
    assert Role.of("kv_both", False).saves and not Role.of("kv_consumer", False).saves
    assert Role.of("kv_consumer", True).saves and Role.of(None, False).name == "kv_both"
    asked = {"do_remote_decode": True}
    assert Role.of("kv_producer", False).hands_off(None)
    assert Role.of("kv_both", False).hands_off(asked) and not Role.of("kv_both", False).hands_off({})
    assert not Role.of("kv_consumer", False).hands_off(asked)


def test_a_consumer_plans_no_saves_unless_told():
    clock = Clock()
    for saves, planned in (("none", 0), ("answers", 1)):
        scheduler = core(set(), SchedulerSettings(prefetch=None, saves=saves), clock)
        assert scheduler.num_new_matched_tokens("r", PROMPT, 0) == 0
        scheduler.on_scheduled("r", list(range(17)), replace=True, computed_after_step=2049)
        assert len(scheduler.take_plan().saves) == planned


def test_the_producer_names_its_stored_prompt_chunks_and_they_round_trip():
    scheduler = core(set(), SchedulerSettings(prefetch=None), Clock())
    scheduler.num_new_matched_tokens("r", PROMPT, 0)
    scheduler.on_scheduled("r", list(range(17)), replace=True, computed_after_step=2050)
    handoff = scheduler.handoff("r", len(PROMPT), "host-p")
    assert handoff == Handoff(8, KEYS[7], "host-p")
    params = {"do_remote_decode": True, **handoff.params()}
    assert Handoff.from_params(params) == handoff
    with pytest.raises(Malformed, match="chunks must be an integer"):
        Handoff.from_params({PARAMS_KEY: {"chunks": "x"}})
    assert Handoff.from_params(None) is None


def test_the_consumer_waits_for_exactly_the_named_chunks_then_loads():
    clock, present = Clock(), set(KEYS[:3])
    scheduler = core(present, SchedulerSettings(prefetch=None, handoff_wait_s=2.0), clock)
    scheduler.expect_handoff("r", Handoff(8, KEYS[7]))
    assert scheduler.num_new_matched_tokens("r", PROMPT, 0) is None  # 3 of 8 readable
    clock.now += 0.5
    present.update(KEYS[3:8])
    assert scheduler.num_new_matched_tokens("r", PROMPT, 0) == 8 * CHUNK
    counters = scheduler.take_counters()
    assert counters["handoff.waited"] == 1 and counters["handoff.wait_ms"] == 500
    assert counters.get("handoff.expired", 0) == 0


def test_a_held_request_has_its_service_await_the_named_chunks_once():
    """The producer's saves may still be on their way, and the consumer's lookups may skip
    the index meanwhile (its backoff): the service is told, at the first hold, to watch
    for the named chunks of every rank, for as long as the hold lasts."""
    told: list[tuple[str, list[list[bytes]], float]] = []
    clock = Clock()
    ranks = [chunk_keys(PROMPT, KVNamespace("m", "float16", "cpu", CHUNK, Shard(TensorParallel(rank, 2))))
             for rank in range(2)]
    present = set(ranks[0][:3])
    scheduler = core(present, SchedulerSettings(prefetch=None, handoff_wait_s=2.0), clock, ranks=2,
                     notify=lambda kind, keys, in_s, end=None: told.append((kind, keys, in_s)))
    scheduler.expect_handoff("r", Handoff(8, ranks[0][7]))
    for _ in range(3):
        assert scheduler.num_new_matched_tokens("r", PROMPT, 0) is None
        clock.now += 0.1
    assert told == [("await", [ranks[0][:8], ranks[1][:8]], 2.0)]
    present.update(ranks[0])
    assert scheduler.num_new_matched_tokens("r", PROMPT, 0) == 8 * CHUNK
    scheduler.expect_handoff("ready", Handoff(8, ranks[0][7]))
    assert scheduler.num_new_matched_tokens("ready", PROMPT, 0) == 8 * CHUNK
    assert len(told) == 1  # a request not held awaits nothing


def test_past_the_deadline_the_consumer_loads_what_is_there_and_recomputes_the_rest():
    clock, present = Clock(), set(KEYS[:2])
    scheduler = core(present, SchedulerSettings(prefetch=None, handoff_wait_s=2.0), clock)
    scheduler.expect_handoff("r", Handoff(8, KEYS[7]))
    assert scheduler.num_new_matched_tokens("r", PROMPT, 0) is None
    clock.now += 2.0
    assert scheduler.num_new_matched_tokens("r", PROMPT, 0) == 2 * CHUNK
    assert scheduler.num_new_matched_tokens("r", PROMPT, 0) == 2 * CHUNK  # held once only
    assert scheduler.take_counters()["handoff.expired"] == 1


def test_a_handoff_naming_another_prompt_is_not_waited_for():
    scheduler = core(set(), SchedulerSettings(prefetch=None), Clock())
    other = chunk_keys(PROMPT, KVNamespace("other-model", "float16", "cpu", CHUNK))
    scheduler.expect_handoff("r", Handoff(8, other[7]))
    assert scheduler.num_new_matched_tokens("r", PROMPT, 0) == 0
    assert scheduler.take_counters()["handoff.mismatch"] == 1


def test_the_chunk_with_the_last_prompt_token_is_not_waited_for():
    """A prompt of exactly 8 chunks: a load never covers its last token, so 7 suffice."""
    exact = PROMPT[:2048]
    scheduler = core(set(KEYS[:7]), SchedulerSettings(prefetch=None), Clock())
    scheduler.expect_handoff("r", Handoff(8, KEYS[7]))
    assert scheduler.num_new_matched_tokens("r", exact, 0) == 7 * CHUNK


def test_a_producer_in_a_cluster_must_write_through(tmp_path):
    cluster = {"host_id": "p", "index_url": "redis://127.0.0.1:1/0"}
    tiers = {"dram": {"capacity": "64MiB"}, "disk": [{"path": str(tmp_path), "capacity": "64MiB"}]}
    back = load_config({"tiers": tiers, "cluster": cluster})
    with pytest.raises(ConfigError, match="write_through"):
        check_producer_store(Role.of("kv_producer", False), back)
    check_producer_store(Role.of("kv_both", False), back)
    check_producer_store(Role.of("kv_producer", False),
                         load_config({"tiers": tiers, "cluster": cluster, "write_policy": "write_through"}))
    check_producer_store(Role.of("kv_producer", False), load_config({"tiers": tiers}))  # one host


def test_counters_keep_counting_after_they_are_taken():
    """The save tracker and the handoff waits share the core's counters: taking them must
    not leave those counting into an object nobody reads."""
    clock = Clock()
    scheduler = core(set(KEYS), SchedulerSettings(prefetch=None), clock)
    for req_id in ("r1", "r2"):
        scheduler.expect_handoff(req_id, Handoff(8, KEYS[7]))
        scheduler.num_new_matched_tokens(req_id, PROMPT, 0)
        assert scheduler.take_counters()["handoff.ready"] == 1, req_id
