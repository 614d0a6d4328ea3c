"""kvstore as a secondary tier of vLLM's tiered offloading (engine_plugin/vllm/tier.py),
against vLLM's real tiering layer: its TieringOffloadingSpec loads the tier by module path
and builds its TieringOffloadingManager over a real CPU-tier region in /dev/shm; the rig
(bench/support/vllm_offload.py) plays the GPU's part, writing and reading CPU-tier rows,
and steps the scheduler. Each test runs its own kvstore service (spawned by the tier),
with a disk tier on a filesystem that takes O_DIRECT."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="needs the vllm extra (pip install -e .[vllm])")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.records import corrupt_record, disk_records
from support.services import counters, service_client, service_config, stop_service
from support.stalls import stall_meter
from vllm.v1.kv_offload.base import LookupResult, Medium, make_offload_key

from bench.support.processes import paused
from bench.support.vllm_offload import OffloadRig, kvstore_tier, offload_key, offloading_spec, payload
from connectors.link import ServiceLink
from engine_plugin.vllm.core.chain_reports import ChainReports
from engine_plugin.vllm.core.tier_lookups import TierLookups, Verdict
from engine_plugin.vllm.tier import ASK_DEADLINES, CHORES_WAITING, KVStoreTier, RequestChains, tier_weights
from kvstore.config.store import load_config
from kvstore.format.errors import ConfigError
from kvstore.format.keys import Weights
from kvstore.service.client import StoreClient
from kvstore.tiers.return_rates import RequestEnd

ROW = 64 << 10  # one CPU-tier row: one kvstore chunk
ROWS = 48
COUNT = 6


@pytest.fixture
def store(tmp_path, disk_dir) -> Iterator[dict]:
    """A service of its own: 8 MiB of DRAM over a 32 MiB disk tier, a patient I/O deadline
    (disk reads right after a restart, on a busy 2-core machine)."""
    config = service_config(tmp_path, dram="8MiB", disk_dir=disk_dir, disk="32MiB", io={"timeout_s": 5.0},
                            socket="run/kvstore.sock", staging="2MiB")
    yield config
    stop_service(config)


def rig_of(store: dict, rows: int = ROWS, **options) -> OffloadRig:
    return OffloadRig(offloading_spec([kvstore_tier(store, **options)], ROW, rows))


@pytest.fixture
def rig(store) -> Iterator[OffloadRig]:
    made = rig_of(store)
    yield made
    made.close()


def keys_of(names) -> list:
    return [offload_key(name) for name in names]


def stored(rig: OffloadRig, names) -> None:
    assert rig.store(keys_of(names), [payload(n, ROW) for n in names]) == len(names)


def verdicts(rig: OffloadRig, names) -> list[str]:
    """Each loaded chunk: its own bytes ("equal"), a miss, or anything else ("other")."""
    loaded = rig.load(keys_of(names))
    return ["miss" if got is None else "equal" if got == payload(n, ROW) else "other"
            for n, got in zip(names, loaded, strict=True)]


def test_vllms_factory_loads_the_tier_which_stores_finds_and_loads_through_vllms_manager(rig):
    assert isinstance(rig.tier, KVStoreTier)
    stored(rig, range(COUNT))
    rig.empty_cpu_tier()  # what loads now comes from kvstore
    context = rig.context("first-sight", keys_of([0]))
    assert rig.tier.lookup(offload_key(0), context) is LookupResult.RETRY  # never waits on the service
    rig.manager.on_request_finished(context)
    assert verdicts(rig, range(COUNT)) == ["equal"] * COUNT
    assert verdicts(rig, ["never-stored"]) == ["miss"]


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_restart_finds_what_was_written_and_a_flipped_byte_is_a_miss(store, prefetch):
    """With prefetch the service's promotion of the run finds the flipped record first (the
    run it answers ends before it); without, the load job reads it and reports that chunk
    failed. Either way vLLM keeps the chunk before it and recomputes from it."""
    first = rig_of(store)
    try:
        stored(first, range(COUNT))
        flipped = first.tier.keys.of(offload_key(1))
    finally:
        first.close()
    stop_service(store)  # DRAM is written down, the service gone: the next one reads disk
    corrupt_record(store["tiers"]["disk"][0]["path"], key=flipped)
    fresh = rig_of(store, prefetch=prefetch)
    try:
        assert verdicts(fresh, range(COUNT)) == ["equal"] + ["miss"] * (COUNT - 1)
        assert verdicts(fresh, [1]) == ["miss"]
        assert verdicts(fresh, range(2, COUNT)) == ["equal"] * (COUNT - 2)
    finally:
        fresh.close()
    seen = counters(store)
    assert seen["disk.miss.bad_checksum"] == 1, seen
    if prefetch:  # disk hits: the wait policy held the request (RETRY) while the service promoted them
        assert seen["prefetch.requests"] >= 1 and seen["prefetch.disk_chunks"] >= COUNT, seen
        assert seen["prefetch.late_requests"] >= 1, seen  # held: its first answer had them on disk
    else:
        assert seen["load.failed_chunks"] == 1, seen


def test_a_full_tier_stays_within_its_capacity_and_never_serves_other_bytes(tmp_path, disk_dir):
    small = service_config(tmp_path, dram="1MiB", disk_dir=disk_dir, disk="4MiB", io={"timeout_s": 5.0},
                           socket="run/kvstore.sock", staging="1MiB")
    rig = rig_of(small)
    try:
        names = list(range(120))  # about twice what DRAM and disk hold together
        for start in range(0, len(names), 12):
            stored(rig, names[start : start + 12])
        rig.empty_cpu_tier()
        found = [verdicts(rig, [n])[0] for n in names]
        assert "other" not in found and found[-1] == "equal", found
        assert 0 < found.count("equal") < len(names), found  # the oldest were dropped
        client = service_client(small)
        try:
            tiers = client.info()["tiers"]
        finally:
            client.close()
        assert all(tier["used_bytes"] <= tier["capacity_bytes"] for tier in tiers), tiers
    finally:
        rig.close()
        stop_service(small)


def test_two_engines_share_one_store_and_other_weights_share_nothing(store, rig):
    stored(rig, range(COUNT))
    second = rig_of(store)
    other_weights = rig_of(store, model_revision="another")
    try:
        assert verdicts(second, range(COUNT)) == ["equal"] * COUNT
        assert verdicts(other_weights, range(COUNT)) == ["miss"] * COUNT
    finally:
        second.close()
        other_weights.close()


def test_after_vllms_reset_the_engine_loads_nothing_it_stored_before_and_others_still_do(store, rig):
    """vLLM resets its caches at a weight update (and at sleep and wake-up) and leaves its
    secondary tiers alone; weights updated in place keep their files' fingerprint. So the
    tier keys by a new generation from then on: what this engine stored before is never
    loaded by it again (recomputed with the new weights), and nothing is deleted."""
    stored(rig, range(COUNT))
    rig.empty_cpu_tier()
    assert verdicts(rig, range(COUNT)) == ["equal"] * COUNT
    rig.reset()
    assert verdicts(rig, range(COUNT)) == ["miss"] * COUNT
    watcher = service_client(store)
    try:  # announced, so `kvstore purge --list` can name it
        deadline = time.monotonic() + 10
        while len({entry["description"].get("generation") for entry in watcher.namespaces()}) < 2:
            assert time.monotonic() < deadline, "the new generation was not announced"
            time.sleep(0.05)
    finally:
        watcher.close()
    stored(rig, ["after"])  # stored and loaded under the new generation
    rig.empty_cpu_tier()
    assert verdicts(rig, ["after"]) == ["equal"]
    other = rig_of(store)  # another engine on the old weights
    try:
        assert verdicts(other, range(COUNT)) == ["equal"] * COUNT
        assert verdicts(other, ["after"]) == ["miss"]
    finally:
        other.close()


def test_a_hugging_face_id_needs_its_revision_and_a_local_checkpoint_is_fingerprinted(tmp_path):
    """vLLM's offloading config names the model, not the revision vLLM loaded: where vLLM's
    own config is not current, a Hugging Face id without model_revision is refused rather
    than keyed by whatever snapshot `main` names."""
    with pytest.raises(ConfigError, match="model_revision"):
        tier_weights("org/not-a-local-path", None)
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    (checkpoint / "config.json").write_text("{}")
    assert tier_weights(str(checkpoint), None).fingerprint.startswith("sha256:")
    assert tier_weights("org/not-a-local-path", "r1") == Weights("rev:r1")


def test_each_kv_cache_group_is_keyed_and_stored_in_a_namespace_of_its_own(store):
    """A hybrid model's groups: each chunk under its group's namespace (its records' headers
    name it), each namespace announced; a group not offloaded here is no key."""
    rig = OffloadRig(offloading_spec([kvstore_tier(store)], ROW, ROWS, groups=2))
    try:
        keys = [offload_key(n, group) for group in (0, 1) for n in range(3)]
        assert rig.store(keys, [payload(key.hex(), ROW) for key in keys]) == len(keys)
        namespaces = {group: ns.digest() for group, ns in rig.tier.keys.namespaces.items()}
        assert len(set(namespaces.values())) == 2 and rig.tier.keys.of(offload_key(0, 2)) is None
        rig.empty_cpu_tier()
        assert rig.load(keys) == [payload(key.hex(), ROW) for key in keys]
    finally:
        rig.close()
    client = service_client(store)
    try:
        announced = {bytes.fromhex(ns["namespace"]) for ns in client.namespaces()}
    finally:
        client.close()
    assert set(namespaces.values()) <= announced, announced
    stop_service(store)
    assert {header.namespace for header in disk_records(store["tiers"]["disk"][0]["path"])} == set(
        namespaces.values())


def test_a_groups_lookups_are_a_run_of_their_own(store):
    """vLLM scans each KV cache group's chunks apart, in one step: a chunk missing in one
    group ends that group's run only."""
    rig = OffloadRig(offloading_spec([kvstore_tier(store)], ROW, ROWS, groups=2))
    try:
        first, second = [offload_key(n, 0) for n in range(3)], [offload_key(n, 1) for n in range(3)]
        kept = [first[0], first[2], *second]  # group 0's chunk 1 never stored
        assert rig.store(kept, [payload(key.hex(), ROW) for key in kept]) == len(kept)
        rig.empty_cpu_tier()
        context = rig.context("two-groups", first + second)
        found = [rig.manager.lookup(key, context) for key in first + second]
        given_up = time.monotonic() + 30
        while LookupResult.RETRY in found and time.monotonic() < given_up:
            rig.step()
            time.sleep(0.01)
            found = [rig.manager.lookup(key, context) for key in first + second]
        loaded = {LookupResult.HIT, LookupResult.HIT_PENDING}
        assert found[0] in loaded and found[1] is LookupResult.MISS, found
        assert all(result in loaded for result in found[3:]), found
        rig.manager.on_request_finished(context)
        rig.settle()
    finally:
        rig.close()


def test_a_sliding_window_groups_chunks_asked_from_the_end_each_find_their_own_answer(store):
    """vLLM scans a sliding-window group from the prompt's end back (a window of hits
    nearest the end): a follow-up's new chunks, not stored yet, come first. Each chunk asked
    is found or not for itself; asked as one run in that order, the first absent chunk
    turned every stored one before it into a miss."""
    rig = OffloadRig(offloading_spec([kvstore_tier(store)], ROW, ROWS))
    try:
        keys = [offload_key(n, 0) for n in range(5)]
        kept = keys[:3]  # the earlier turn's chunks; the follow-up's last two never stored
        assert rig.store(kept, [payload(key.hex(), ROW) for key in kept]) == len(kept)
        rig.empty_cpu_tier()
        context = rig.context("from-the-end", keys)
        backwards = keys[::-1]
        found = [rig.manager.lookup(key, context) for key in backwards]
        given_up = time.monotonic() + 30
        while LookupResult.RETRY in found and time.monotonic() < given_up:
            rig.step()
            time.sleep(0.01)
            found = [rig.manager.lookup(key, context) for key in backwards]
        loaded = {LookupResult.HIT, LookupResult.HIT_PENDING}
        assert found[:2] == [LookupResult.MISS, LookupResult.MISS], found
        assert all(result in loaded for result in found[2:]), found
        rig.manager.on_request_finished(context)
        rig.settle()
    finally:
        rig.close()


def test_a_stopped_service_costs_misses_within_the_deadline(store):
    store["io"]["timeout_s"] = 1.0  # each request to the service: 2 s at most
    rig = rig_of(store)
    try:
        stored(rig, range(COUNT))
        rig.empty_cpu_tier()
        client = service_client(store)
        try:
            pid = int(client.info()["service_pid"])
        finally:
            client.close()
        with paused(pid):
            started = time.monotonic()
            assert verdicts(rig, range(COUNT)) == ["miss"] * COUNT
            assert time.monotonic() - started <= ASK_DEADLINES * 1.0 + 5  # the lookups' deadline, and slack
            started = time.monotonic()
            assert rig.store(keys_of(["while-stopped"]), [payload("while-stopped", ROW)]) == 1
            assert time.monotonic() - started <= 2 * 2.0 + 5  # the store job's request deadline, and slack
            assert not rig.tier.has_pending_work()
    finally:
        rig.close()


def test_best_effort_requests_never_delay_a_lookup_nor_pile_up_behind_a_slow_service(store, tmp_path):
    """Counters, request ends, touches and event polls go on a lane of their own, at most
    CHORES_WAITING of them waiting: behind a slow service (each of its answers 0.05 s, here
    in the call) the rest are dropped and counted, a lookup is answered in its own time, and
    shutting down does not wait for the backlog."""
    rig = rig_of(store)
    stored(rig, range(COUNT))
    rig.empty_cpu_tier()

    def slow(client):
        time.sleep(0.05)
        return client.count({})

    lane, running, release = rig.tier.chores, threading.Event(), threading.Event()

    def held(client):  # the lane's thread busy with one while the rest come
        running.set()
        release.wait(10)

    lane.submit(held)
    assert running.wait(10)
    for _ in range(CHORES_WAITING + 100):
        lane.submit(slow)
    assert lane.take_dropped() == 100
    release.set()
    with stall_meter(tmp_path) as meter:  # each less any time the machine stalled
        found, seconds, stalled = meter.timed(lambda: verdicts(rig, range(COUNT)))
        assert found == ["equal"] * COUNT and seconds - stalled < CHORES_WAITING * 0.05  # not behind them
        _, seconds, stalled = meter.timed(rig.close)
        assert seconds - stalled < CHORES_WAITING * 0.05 / 2  # the waiting ones were dropped


def test_touched_chunks_are_brought_into_dram(store):
    """vLLM's manager touches chunks in every tier: kvstore promotes a touched run's disk
    part into its DRAM tier."""
    first = rig_of(store)
    try:
        stored(first, range(COUNT))
        ours = [first.tier.keys.of(key) for key in keys_of(range(COUNT))]
    finally:
        first.close()
    stop_service(store)  # on disk only
    fresh = rig_of(store)
    client = service_client(store)
    try:
        assert client.residency(ours)[:2] == (COUNT, 0)
        fresh.manager.touch(keys_of(range(COUNT)), fresh.context("touch", keys_of(range(COUNT))))
        given_up = time.monotonic() + 30
        while client.residency(ours)[1] < COUNT and time.monotonic() < given_up:
            time.sleep(0.05)
        assert client.residency(ours)[:2] == (COUNT, COUNT)
    finally:
        client.close()
        fresh.close()


def test_a_lookup_the_service_has_not_answered_misses_at_its_deadline(store):
    """The scheduler's side bounds every lookup, whatever holds the lookup thread (here a
    request to a stopped service with a 30 s deadline)."""
    link = ServiceLink(lambda: StoreClient(load_config(store), timeout_s=30.0))
    link.start()
    client = link.get()
    assert client is not None
    pid = int(client.info()["service_pid"])
    lookups = TierLookups(link, None, deadline_s=0.5)
    key = bytes(16)
    try:
        with paused(pid):
            assert lookups.verdict("r", key, 16) is Verdict.WAIT
            lookups.flush()
            given_up = time.monotonic() + 10
            while (verdict := lookups.verdict("r", key, 16)) is Verdict.WAIT and time.monotonic() < given_up:
                time.sleep(0.05)
            assert verdict is Verdict.MISS and time.monotonic() < given_up
    finally:
        lookups.close()


def test_a_request_end_tells_the_service_its_stored_chain_and_turn():
    """What vLLM's interface gives a tier of a request's end (the chunks it saw, where they
    end) feeds disk admission: its stored chain, its turn (a later request that holds its
    last chunk continues it) and how long that chain sat idle. A request that stored
    nothing tells nothing."""
    told: list[tuple] = []
    chains = RequestChains(ChainReports(lambda kind, ranks, in_s, end=None: told.append((kind, ranks, end)),
                                        chunk_tokens=16))
    first, more = [bytes([i]) * 16 for i in range(3)], bytes([9]) * 16
    for i, key in enumerate(first):
        chains.saw("a", 0, (i + 1) * 16, key)
    chains.stored("a", first)
    chains.ended("a")
    assert told == [("finished", [first], RequestEnd(0, 0, None))]
    for i, key in enumerate([*first, more]):
        chains.saw("b", 0, (i + 1) * 16, key)
    assert chains.parent("b", 0, 64) == first[-1]  # a store of the new chunk chains under it
    chains.stored("b", [more])
    chains.saw("c", 0, 16, first[0])
    chains.ended("c")
    chains.ended("b")
    _, ranks, end = told[-1]
    assert len(told) == 2 and ranks == [[more]] and end.turn == 1 and end.idle_s is not None


def test_the_module_path_configs_named_before_the_engines_rooms_still_loads(store):
    """docs/vllm.md names engine_plugin.vllm.tier; a config written before each engine had
    its room names engine_plugin.vllm_tier, and vLLM's offloading still makes the tier."""
    rig = OffloadRig(offloading_spec([kvstore_tier(store, module_path="engine_plugin.vllm_tier")], ROW, ROWS))
    try:
        assert isinstance(rig.tier, KVStoreTier)
    finally:
        rig.close()


def test_the_tier_takes_only_the_options_that_apply_to_it(store):
    with pytest.raises(ConfigError, match="save_answers"):
        rig_of(store, save_answers=False)
    with pytest.raises(ConfigError, match="config"):
        OffloadRig(offloading_spec([{"type": "KVStoreTier", "module_path": "engine_plugin.vllm.tier",
                                     "model_revision": "x"}], ROW, ROWS))


def test_chunk_events_name_vllms_keys_owned_by_the_tier(store):
    rig = OffloadRig(offloading_spec([kvstore_tier(store, enable_kv_events=True)], ROW, ROWS, events=True))
    try:
        stored(rig, range(3))
        events = []
        for _ in range(200):
            rig.step()
            events += [e for e in rig.tier.take_events() if not e.removed]
            if {k for e in events for k in e.keys} >= set(keys_of(range(3))):
                break
            time.sleep(0.01)
        mine = [e for e in events if e.medium is Medium.CPU]  # kvstore's DRAM
        assert {k for e in mine for k in e.keys} == set(keys_of(range(3))), events
        assert {e.ownership for e in events} == {"KVStoreTier"}
    finally:
        rig.close()


def _mutations(key: bytes) -> st.SearchStrategy[bytes]:
    """Keys near a stored one: a bit flipped, another group, cut short, grown."""
    return st.one_of(
        st.integers(0, len(key) * 8 - 1).map(lambda bit: bytes(
            b ^ (1 << bit % 8) if i == bit // 8 else b for i, b in enumerate(key))),
        st.integers(1, 2**32 - 1).map(lambda group: make_offload_key(key[:-4], group)),
        st.integers(0, len(key) - 1).map(lambda n: key[:n]),
        st.binary(min_size=1, max_size=8).map(lambda tail: key + tail))


def test_hostile_keys_never_raise_and_never_load_what_they_do_not_name(store, rig):
    """Made-up offload keys (any bytes, and near misses of stored ones): a lookup is a HIT
    only for a key stored, never an exception; one stored is stored under its own key, if
    it is a SHA-256 block hash of the group offloaded, and loads its own bytes."""
    names = list(range(COUNT))
    stored(rig, names)
    rig.empty_cpu_tier()
    named = set(keys_of(names))
    seen = {"examples": 0}

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(st.one_of(st.binary(max_size=64), st.sampled_from(sorted(named)).flatmap(_mutations)))
    def one(key: bytes) -> None:
        seen["examples"] += 1
        n = seen["examples"]
        context = rig.context(f"hostile-{n}", [key])
        try:
            (result,) = rig.lookup([key], context)
        finally:
            rig.manager.on_request_finished(context)
        assert result is (LookupResult.HIT if key in named else LookupResult.MISS), key.hex()
        if key in named:
            return
        assert rig.store([key], [payload(key.hex(), ROW)], f"hostile-store-{n}") == 1
        rig.empty_cpu_tier()
        well_formed = len(key) == 36 and key[-4:] == bytes(4)  # group 0, the one offloaded
        assert rig.load([key], f"hostile-load-{n}") == [payload(key.hex(), ROW) if well_formed else None]
        if well_formed:
            named.add(key)

    one()
    rig.step()  # the counters go to the service with a step's end
    rig.settle()
    assert counters(store)["malformed.offload_key"] > 0


def test_the_benchmark_sets_the_tier_beside_vllms_fs_tier_on_the_same_disk(disk_dir, capsys):
    from bench.lab.vllm_tier import main

    rounds = main(["--total", "16MiB", "--dir", disk_dir, "--fio-seconds", "0", "--full-disk", "64MiB",
                   "--chunks-per-request", "8", "--requests-at-once", "2"])
    assert {(r.backend, r.hits) for r in rounds} == {("kvstore", "warm"), ("kvstore", "disk"),
                                                     ("vLLM fs", "disk")}
    assert all(r.verified and r.gib_s > 0 and r.cpu_s_per_gib > 0 for r in rounds), rounds
    printed = capsys.readouterr().out
    assert "kvstore: equal 1, miss 7" in printed and "vLLM fs: equal 1, WRONG 1, equal 6" in printed, printed
    if "not run" not in printed:  # a loop-mounted filesystem (root): kvstore keeps the newest
        # (and the first request too where the DRAM cleaner fell behind these back-to-back
        # saves: a put then passes over DRAM's unwritten chunks and goes to disk)
        assert re.search(r"kvstore: first request \d/8, last 8/8", printed), printed
        assert "vLLM fs: first request 8/8, last 0/8" in printed, printed
