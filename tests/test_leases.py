"""One-copy loads: the shared DRAM tier, pins held across requests (disk hits read into
DRAM slots first), and their release on every path."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial

import numpy as np
import pytest
import torch
import xxhash
from support import faults
from support.records import corrupt_record
from support.services import service_config, stop_service

from bench.support.processes import paused
from engine_plugin.vllm.core.plan import Transfer
from engine_plugin.vllm.core.worker_side import WorkerCore
from engine_plugin.vllm.layout import PagedKVLayout
from kvstore.config.store import load_config
from kvstore.format.errors import KVStoreError
from kvstore.format.record import record_bytes
from kvstore.io.faulty import Fault
from kvstore.service.client import StoreClient
from kvstore.service.client_connection import ServiceUnavailable
from kvstore.store.tiered import TieredStore
from kvstore.tiers.dram import DramTier

CHUNK = 64 * 1024
SLOTS = 8  # DRAM slots of the service below; its windows hold 16 chunks


def _keys(first: int, count: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in range(first, first + count)]


@pytest.fixture
def config(tmp_path):
    raw = service_config(tmp_path, dram=SLOTS * record_bytes(CHUNK))
    yield raw
    stop_service(raw)


@contextlib.contextmanager
def _mapped(store: TieredStore) -> Iterator[mmap.mmap]:
    """The DRAM tier as an engine maps it (TieredStore.share_dram): read-only."""
    shared = store.shared_dram.share()
    assert shared is not None
    fd, nbytes, _pages = shared
    try:
        with mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as tier:
            yield tier
    finally:
        os.close(fd)


def _put(client: StoreClient, keys: list[bytes]) -> list[bool]:
    for slot, key in enumerate(keys):
        client.memory.slot(slot)[:] = key[:1] * CHUNK
    return client.put(keys, range(len(keys)))


def test_a_client_reads_pinned_chunks_from_the_tier_and_cannot_write_it(config):
    client = StoreClient(load_config(config), CHUNK)
    try:
        assert client.memory.tier is not None and client.memory.tier.view.readonly
        keys = _keys(1, 3)
        assert _put(client, keys) == [True] * 3
        lease, offsets, _ = client.pin([*keys, b"\xee" * 16])
        assert offsets[3] == -1
        assert [bytes(client.memory.tier_payload(o)) for o in offsets[:3]] == [k[:1] * CHUNK for k in keys]
        with pytest.raises(TypeError):
            client.memory.tier.view[offsets[0]] = 0
        client.unpin([lease])
        with pytest.raises(KVStoreError, match="more than its window"):
            client.pin(_keys(1, 3) * 6)
    finally:
        client.close()


def test_the_shared_tier_refuses_writable_maps():
    tier = DramTier(4 * record_bytes(CHUNK), record_bytes(CHUNK), shared=True)
    shared = tier.share()
    assert shared is not None
    fd, nbytes, _ = shared
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError):
            os.write(fd, b"x")
        mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ).close()
    finally:
        os.close(fd)
        tier.close()


def test_a_pinned_slot_is_never_evicted_or_reused_until_released():
    with TieredStore({"tiers": {"dram": {"capacity": 4 * record_bytes(CHUNK)}}}, CHUNK) as store:
        first = _keys(1, 4)
        assert store.put_many(first, [k[:1] * CHUNK for k in first]) == [True] * 4
        lease = store.shared_dram.lease(first[:2])
        for wave in (_keys(10, 4), _keys(20, 4)):  # every unpinned slot is taken, twice over
            store.put_many(wave, [k[:1] * CHUNK for k in wave])
        assert store.lookup(first[:2]).tiers == ("dram", "dram")
        with _mapped(store) as tier:
            assert [tier[o : o + CHUNK] for o in lease.offsets] == [k[:1] * CHUNK for k in first[:2]]
        store.shared_dram.release(lease)
        store.shared_dram.release(lease)  # a second release does nothing
        wave = _keys(30, 4)
        assert store.put_many(wave, [k[:1] * CHUNK for k in wave]) == [True] * 4
        assert store.lookup(first[:1]).count == 0


_PINNER = """
import json, sys, time
from kvstore.config.store import load_config
from kvstore.service.client import StoreClient
client = StoreClient(load_config(json.loads(sys.argv[1])), int(sys.argv[2]))
lease, offsets, _ = client.pin([bytes([i]) * 16 for i in range(1, 9)])
print(sum(o >= 0 for o in offsets), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("leaves", ["killed", "closed"])
def test_the_service_releases_the_pins_of_a_client_that_leaves_holding_them(config, leaves):
    client = StoreClient(load_config(config), CHUNK)
    try:
        assert _put(client, _keys(1, SLOTS)) == [True] * SLOTS
        if leaves == "killed":
            child = subprocess.Popen([sys.executable, "-c", _PINNER, json.dumps(config), str(CHUNK)],
                                     stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
            assert child.stdout is not None and child.stdout.readline().strip() == str(SLOTS)
        else:
            holder = StoreClient(load_config(config), CHUNK)
            assert holder.pin(_keys(1, SLOTS))[1].count(-1) == 0
        assert _put(client, _keys(20, 1)) == [False]  # every DRAM slot is pinned, and no disk
        if leaves == "killed":
            child.send_signal(signal.SIGKILL)
            child.wait()
        else:
            holder.close()
        deadline = time.monotonic() + 10  # the service notices the closed connection on its own thread
        while _put(client, _keys(20, 1)) != [True] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.residency(_keys(20, 1)) == (1, 1, False)
    finally:
        client.close()


@pytest.mark.parametrize("share", ["own-user", "off"])
def test_a_load_copies_from_the_tier_or_through_the_window_into_descending_blocks(config, share):
    config = {**config, "service": {**config["service"], "share_dram": share}}
    caches = {"layer": torch.zeros(16, 2, 16, 64, dtype=torch.float16)}  # 4 KiB per block
    layout = PagedKVLayout(caches, 16, 16)
    payload = np.random.default_rng(0).integers(0, 256, CHUNK, dtype=np.uint8)
    writer = StoreClient(load_config(config), CHUNK)
    try:
        assert (writer.memory.tier is None) == (share == "off")
        writer.memory.slot(0)[:] = payload.tobytes()
        assert writer.put([b"k" * 16], [0]) == [True]
    finally:
        writer.close()
    worker = WorkerCore(layout, 0, partial(StoreClient, load_config(config), CHUNK))
    try:
        loading, saving = worker.loads.link.get(), worker.saves.link.get()
        assert loading is not None and saving is not None
        assert (loading.memory.tier is None) == (share == "off")
        assert saving.memory.tier is None  # only the loading client maps the tier
        worker.start_loads([Transfer("r", ((b"k" * 16, b"m" * 16),), (None,),
                                     (tuple(range(15, -1, -1)), tuple(range(16))), load_async=False)])
        assert worker.take_failed_blocks() == set(range(16))  # the second chunk is a miss
    finally:
        worker.close()
    loaded = caches["layer"].view(torch.uint8).numpy().reshape(16, -1)
    assert np.array_equal(loaded[::-1].reshape(-1), payload)


def _disk_config(disk_dir: str) -> dict:
    return {"tiers": {"dram": {"capacity": 4 * record_bytes(CHUNK)},
                      "disk": [{"path": disk_dir, "capacity": 32 * record_bytes(CHUNK)}]},
            "io": {"timeout_s": 5}}


def test_a_disk_hit_is_read_into_a_dram_slot_verified_there_and_leased(disk_dir, store_factory):
    keys = _keys(1, 4)
    first = store_factory(_disk_config(disk_dir))
    assert first.put_many(keys, [k[:1] * CHUNK for k in keys]) == [True] * 4
    first.close()  # every chunk on disk, DRAM empty at the next start
    corrupt_record(disk_dir, keys[1][0])
    store = store_factory(_disk_config(disk_dir))
    assert store.lookup(keys).tiers == ("disk",) * 4
    lease = store.shared_dram.lease([*keys[:3], b"\xee" * 16])
    assert lease.offsets[1] == lease.offsets[3] == -1  # did not verify; absent
    with _mapped(store) as tier:
        assert [tier[o : o + CHUNK] for o in (lease.offsets[0], lease.offsets[2])] == [
            keys[0][:1] * CHUNK, keys[2][:1] * CHUNK]
    counters = store.stats.snapshot()
    assert counters["disk.hits"] == counters["dram.leased"] == 2
    assert counters["disk.miss.bad_checksum"] == 1
    assert store.lookup(keys[:1]).tiers == ("dram",)
    others = _keys(10, 8)  # DRAM turns over twice; the leased slots stay
    store.put_many(others, [k[:1] * CHUNK for k in others])
    with _mapped(store) as tier:
        assert [tier[o : o + CHUNK] for o in (lease.offsets[0], lease.offsets[2])] == [
            keys[0][:1] * CHUNK, keys[2][:1] * CHUNK]
    assert store.lookup([keys[0]]).tiers == ("dram",)
    store.shared_dram.release(lease)
    assert store.lookup([keys[1]]).count == 0  # the record that did not verify left the index


def test_a_lease_whose_disk_read_fails_any_way_leaves_no_pin(disk_dir, store_factory, monkeypatch):
    """A lease pins its DRAM hits, then reads the rest from disk: should that read raise
    (an io_uring that cannot be set up on a new thread), the DRAM hits pinned so far go
    back with the error, so their slots can be evicted again."""
    keys = _keys(1, 4)
    first = store_factory(_disk_config(disk_dir))
    assert first.put_many(keys, [k[:1] * CHUNK for k in keys]) == [True] * 4
    first.close()  # every chunk on disk
    store = store_factory(_disk_config(disk_dir))
    assert store.get_many(keys[:1], [np.zeros(CHUNK, np.uint8)]) == [True]  # keys[0] promoted to DRAM
    assert store.lookup(keys[:1]).tiers == ("dram",)

    faults.disk_reads_raise(store, monkeypatch, OSError(12, "io_uring_setup: Cannot allocate memory"))
    with pytest.raises(OSError):
        store.shared_dram.lease(keys[:2])  # keys[0] from DRAM, keys[1] from disk
    monkeypatch.undo()
    others = _keys(10, 2 * SLOTS)  # DRAM turns over: keys[0] may go
    store.put_many(others, [k[:1] * CHUNK for k in others])
    assert "dram" not in store.lookup(keys[:1]).tiers


def test_a_lease_that_fails_after_its_unverified_disk_hits_releases_each_once(disk_dir, store_factory,
                                                                                monkeypatch):
    """A lease whose disk hits are left for its reader to verify (in DRAM slots, unpublished)
    fails after they landed: each slot is released once (twice, the second release raised
    and hid the error, or freed a slot reserved by another meanwhile)."""
    keys = _keys(1, 2)
    first = store_factory(_disk_config(disk_dir))
    assert first.put_many(keys, [k[:1] * CHUNK for k in keys]) == [True] * 2
    first.close()  # on disk only
    store = store_factory(_disk_config(disk_dir))
    faults.reads_raise_after_the_disk(store, monkeypatch, OSError(5, "after the read"))
    with pytest.raises(OSError):
        store.shared_dram.lease(keys, verify=False)
    monkeypatch.undo()
    assert store.probe.pinned() == 0


@pytest.mark.parametrize("dram", ["free", "all pinned"])
def test_a_worker_loads_disk_hits_from_their_dram_slot_or_through_the_window(disk_dir, tmp_path, dram):
    config = {**_disk_config(disk_dir), **service_config(tmp_path)}
    caches = {"layer": torch.zeros(32, 2, 16, 64, dtype=torch.float16)}  # 4 KiB per block
    layout = PagedKVLayout(caches, 32, 16)
    payloads = [np.random.default_rng(i).integers(0, 256, CHUNK, dtype=np.uint8) for i in range(2)]
    keys = [b"k" * 16, b"m" * 16]
    writer = StoreClient(load_config(config), CHUNK)
    try:
        for slot, payload in enumerate(payloads):
            writer.memory.slot(slot)[:] = payload.tobytes()
        assert writer.put(keys, [0, 1]) == [True, True]
    finally:
        writer.close()
    stop_service(config)  # the next service starts with both chunks on disk only
    holder = StoreClient(load_config(config), CHUNK)
    worker = WorkerCore(layout, 0, partial(StoreClient, load_config(config), CHUNK))
    try:
        if dram == "all pinned":
            fillers = _keys(1, 4)
            assert _put(holder, fillers) == [True] * 4
            assert holder.pin(fillers)[1].count(-1) == 0
        worker.start_loads([Transfer("r", (tuple(keys),), (None,),
                                     (tuple(range(31, 15, -1)), tuple(range(16))), load_async=False)])
        assert worker.take_failed_blocks() == set()
        counters = holder.info()["counters"]
        assert counters["disk.hits"] == 2
        assert counters.get("dram.leased", 0) == (2 if dram == "free" else 4)  # the holder's 4
    finally:
        worker.close()
        holder.close()
        stop_service(config)  # the service it started must not outlive the test
    loaded = caches["layer"].view(torch.uint8).numpy().reshape(32, -1)
    assert np.array_equal(loaded[31:15:-1].reshape(-1), payloads[0])
    assert np.array_equal(loaded[:16].reshape(-1), payloads[1])


@pytest.mark.cuda
def test_a_cuda_load_copies_from_the_tier_registered_for_dma(config):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import gc

    from engine_plugin.vllm.cuda_host import HostRegistration, register_for_dma

    caches = {"layer": torch.zeros(16, 2, 16, 64, dtype=torch.float16, device="cuda")}
    layout = PagedKVLayout(caches, 16, 16)
    payload = np.random.default_rng(0).integers(0, 256, CHUNK, dtype=np.uint8)
    writer = StoreClient(load_config(config), CHUNK)
    try:
        writer.memory.slot(0)[:] = payload.tobytes()
        assert writer.put([b"k" * 16], [0]) == [True]
    finally:
        writer.close()
    registered: dict[bool, HostRegistration] = {}

    def make_client(map_tier: bool) -> StoreClient:
        client = StoreClient(load_config(config), CHUNK, map_tier=map_tier)
        registered[map_tier] = register_for_dma(client.memory)
        return client

    worker = WorkerCore(layout, 0, make_client)
    try:
        assert worker.loads.link.get() is not None
        loading = registered[True]
        assert loading.thread is not None  # the tier is mapped: its registration runs on a thread
        loading.thread.join(60)
        assert loading.ranges >= 2  # the window, and the tier
        assert registered[False].thread is None and registered[False].ranges == 1  # the window alone
        worker.start_loads([Transfer("r", ((b"k" * 16,),), (None,), (tuple(range(15, -1, -1)),),
                                     load_async=False)])
        torch.cuda.synchronize()
        assert worker.take_failed_blocks() == set()
        worker.loads.link.fail()  # a reconnecting worker drops its client: its registration goes
        gc.collect()
        assert loading.ranges == 0
    finally:
        worker.close()
    loaded = caches["layer"].view(torch.uint8).cpu().numpy().reshape(16, -1)
    assert np.array_equal(loaded[::-1].reshape(-1), payload)


def test_the_load_path_benchmark_measures_every_path_it_reports(disk_dir):
    from bench.lab import load_path

    result = load_path.run(chunks=2, layers=2, kv_heads=2, head_dim=64, chunk_tokens=256,
                           block_size=128, repeats=1, blocks="descending", workdir=disk_dir,
                           disk_dir=disk_dir)
    for path in ("tier", "window", "disk_tier", "disk_window"):
        assert result[f"{path}_gib_s"] > 0
    assert result["disk_tier_cpu_s_per_gib"] > 0 and result["disk_tier_vs_window"] > 0


def test_a_shared_dram_tier_in_small_pages_over_a_disk_tier_is_reported(disk_dir, store_factory, caplog):
    store = store_factory(_disk_config(disk_dir))
    shared = store.shared_dram.share()
    assert shared is not None
    os.close(shared[0])
    small_pages = shared[2] == "4k"  # the host decides: both are checked
    assert ("split at each device's segment limit" in caplog.text) == small_pages


def test_a_hung_disk_read_under_a_pin_is_a_miss_within_the_deadline(disk_dir, faulty, store_factory):
    config = _disk_config(disk_dir)
    config["io"]["timeout_s"] = 0.5
    keys = _keys(1, 2)
    first = store_factory(config)
    assert first.put_many(keys, [k[:1] * CHUNK for k in keys]) == [True, True]
    first.close()
    store = store_factory(config, engine=faulty)
    faulty.add(Fault("hang", remaining=1, match=lambda request: request.nbytes > 4096))
    started = time.monotonic()
    lease = store.shared_dram.lease(keys)
    assert time.monotonic() - started < 5
    assert sorted(offset >= 0 for offset in lease.offsets) == [False, True]
    counters = store.stats.snapshot()
    assert counters["disk.miss.timeout"] == 1
    store.shared_dram.release(lease)
    again = store.shared_dram.lease(keys)  # the record stays on disk; the device answers now
    assert all(offset >= 0 for offset in again.offsets)
    with _mapped(store) as tier:
        assert [tier[o : o + CHUNK] for o in again.offsets] == [k[:1] * CHUNK for k in keys]
    store.shared_dram.release(again)


def test_a_client_not_given_the_tier_cannot_pin(config):
    config = {**config, "service": {**config["service"], "share_dram": "off"}}
    client = StoreClient(load_config(config), CHUNK)
    try:
        assert client.memory.tier is None
        assert _put(client, _keys(1, 1)) == [True]
        with pytest.raises(KVStoreError, match="not given the DRAM tier"):
            client.pin(_keys(1, 1))
        assert client.residency(_keys(1, 1)) == (1, 1, False)  # the connection stays usable
    finally:
        client.close()


def test_a_lease_number_of_an_old_connection_names_nothing_on_a_new_one(config):
    """A client that reconnects may still give back its old connection's lease numbers
    (a scheduler's released leases ride on its next lookup): they name no lease of the
    new connection, whose pins stay held."""
    old = StoreClient(load_config(config), CHUNK)
    try:
        assert _put(old, _keys(1, 2)) == [True, True]
        stale, _, _ = old.pin(_keys(1, 1))
    finally:
        old.close()
    new = StoreClient(load_config(config), CHUNK)
    try:
        lease, offsets, _ = new.pin(_keys(1, 2))
        assert lease != stale and all(offset >= 0 for offset in offsets)
        new.unpin([stale])  # the old number: unknown here
        for first in (10, 10 + SLOTS // 2):  # DRAM turns over, the 2 oldest first to go...
            assert _put(new, _keys(first, SLOTS // 2)) == [True] * (SLOTS // 2)
        assert new.residency(_keys(1, 2))[1] == 2  # ...but the 2 pinned stay
    finally:
        new.close()


@pytest.mark.parametrize("how", ["timed out", "not a frame"])
def test_a_request_that_timed_out_leaves_the_pins_held_until_its_owner_closes(config, how):
    """A hung service (SIGSTOP) times a client's request out, or a live one's answer is not
    a frame of the protocol: no request goes out on that connection any more, but it stays
    open, so the pins a copy out of the tier may still be reading under hold until the
    client's owner closes it (closed then, a put could reuse those slots under the copy)."""
    client = StoreClient(load_config(config), CHUNK, timeout_s=0.5)
    filler = StoreClient(load_config(config), CHUNK)
    try:
        assert _put(client, _keys(1, 2)) == [True, True]
        _, offsets, _ = client.pin(_keys(1, 2))
        assert all(offset >= 0 for offset in offsets)
        if how == "timed out":
            service = int(filler.info()["service_pid"])
            with paused(service), pytest.raises(ServiceUnavailable, match="no answer"):
                client.info()
        else:
            faults.next_reply_not_a_frame(client)
            with pytest.raises(ServiceUnavailable, match="not of this protocol"):
                client.info()
        with pytest.raises(ServiceUnavailable):
            client.pin(_keys(1, 1))  # no request after a timed-out one
        for first in (10, 10 + SLOTS // 2):  # DRAM turns over, the 2 oldest first to go...
            assert _put(filler, _keys(first, SLOTS // 2)) == [True] * (SLOTS // 2)
        assert filler.residency(_keys(1, 2))[1] == 2  # ...but the 2 pinned stay
        client.close()
        for first in (20, 20 + SLOTS // 2):
            assert _put(filler, _keys(first, SLOTS // 2)) == [True] * (SLOTS // 2)
        assert filler.residency(_keys(1, 2))[1] == 0  # closed: released
    finally:
        client.close()
        filler.close()


# -- the lease taken at the lookup (a scheduler's), used by its workers ---------------------


def test_a_lookup_leases_the_dram_run_for_every_rank_and_the_workers_copy_it_with_no_request(config):
    """The scheduler's lookup (a connection with no window) pins the leading chunks every
    rank has in DRAM; a worker's connection copies them out of the tier at those offsets with
    no request of its own; puts that fill DRAM meanwhile evict none of them; once released
    (on the next lookup), they may go."""
    worker = StoreClient(load_config(config), CHUNK)
    scheduler = StoreClient(load_config(config))
    try:
        ranks = [_keys(1, 3), _keys(11, 3)]
        assert _put(worker, ranks[0]) == [True] * 3 and _put(worker, ranks[1]) == [True] * 3
        found = scheduler.lookup(ranks, lease_from=0)
        assert (found.stored, found.resident) == (3, 3) and found.lease > 0
        assert all(o >= 0 for rank in found.offsets for o in rank)
        before = worker.info()["counters"].get("get.chunks", 0)
        assert sum(_put(worker, _keys(30, SLOTS))) == SLOTS - 6  # DRAM full: 6 of its 8 slots leased
        for keys, offsets in zip(ranks, found.offsets, strict=True):
            for key, offset in zip(keys, offsets, strict=True):
                assert worker.memory.tier_holds(offset, key)
                assert bytes(worker.memory.tier_payload(offset)) == key[:1] * CHUNK
        assert worker.info()["counters"].get("get.chunks", 0) == before  # no request for the copy
        again = scheduler.lookup([_keys(1, 3)], release=[found.lease])
        assert again.lease == 0 and again.stored == 3
        assert _put(worker, _keys(50, SLOTS)) == [True] * SLOTS
        assert scheduler.lookup(ranks).resident < 3  # released: evictable again
    finally:
        scheduler.close()
        worker.close()


def _counted(client: StoreClient, before: dict, *names: str) -> list[int]:
    counters = client.info()["counters"]
    return [counters.get(name, 0) - before.get(name, 0) for name in names]


def test_a_lookup_leases_from_the_chunk_the_engine_lacks_and_counts_those_as_gets_once_read(config):
    """The chunks before `lease_from` the engine's own cache holds: they are neither pinned
    nor counted as served; the rest of the DRAM run is leased, and counted as a get's hits
    when the lease comes back read (its workers loaded it). One that comes back unread (its
    request was asked again, or loaded nothing) counts no get: `lease.unread`."""
    worker = StoreClient(load_config(config), CHUNK)
    scheduler = StoreClient(load_config(config))
    names = ("get.chunks", "get.hits", "dram.leased", "lease.unread")
    try:
        assert _put(worker, _keys(1, 4)) == [True] * 4
        before = worker.info()["counters"]
        found = scheduler.lookup([_keys(1, 4)], lease_from=3)
        assert found.offsets[0][:3] == (-1, -1, -1) and found.offsets[0][3] >= 0
        assert worker.memory.tier_holds(found.offsets[0][3], _keys(4, 1)[0])
        assert _counted(worker, before, *names) == [0, 0, 1, 0]  # leased: not read yet
        again = scheduler.lookup([_keys(1, 4)], lease_from=2, unread=[found.lease])  # asked again
        assert _counted(worker, before, *names) == [0, 0, 3, 1]
        scheduler.lookup([], release=[again.lease])  # its load copied it
        assert _counted(worker, before, *names) == [2, 2, 3, 1]
        scheduler.lookup([], release=[again.lease])  # a lease goes back once
        assert _counted(worker, before, *names) == [2, 2, 3, 1]
        assert scheduler.lookup([_keys(1, 4)], lease_from=4).lease == 0  # nothing past the run
    finally:
        scheduler.close()
        worker.close()


def test_a_lookup_lease_that_fails_gives_its_share_of_the_budget_back(monkeypatch):
    """The budget is taken before the pin (so two lookups cannot overrun it); a pin that
    fails (any fault of the store's) gives it back: kept, each failure shrank the user's
    budget for good, until its lookups leased nothing."""
    from kvstore.service.client_leases import HeldLeases, LeaseDesk

    with TieredStore({"tiers": {"dram": {"capacity": 4 * record_bytes(CHUNK)}}}, CHUNK) as store:
        keys = _keys(1, 2)
        assert store.put_many(keys, [k[:1] * CHUNK for k in keys]) == [True] * 2
        desk, held = LeaseDesk(2 * CHUNK), HeldLeases(os.geteuid())
        lease = store.shared_dram.lease

        def failing(*args, **kwargs):
            raise KVStoreError("a fault of the store's")

        monkeypatch.setattr(store.shared_dram, "lease", failing)
        for _ in range(3):
            with pytest.raises(KVStoreError):
                desk.lease_run(store, held, [keys], 0, 2)
        monkeypatch.setattr(store.shared_dram, "lease", lease)
        number, offsets = desk.lease_run(store, held, [keys], 0, 2)
        assert number and [len(rank) for rank in offsets] == [2]  # the whole budget is there


def test_a_users_lookup_leases_are_bounded_counted_and_go_with_its_connections(tmp_path):
    raw = service_config(tmp_path, dram=SLOTS * record_bytes(CHUNK), scheduler_leases=4 * CHUNK)
    worker = StoreClient(load_config(raw), CHUNK)
    try:
        assert _put(worker, _keys(1, 6)) == [True] * 6
        scheduler = StoreClient(load_config(raw))
        first = scheduler.lookup([_keys(1, 3)], lease_from=0, counters={"load.chunks": 2})
        second = scheduler.lookup([_keys(1, 3), _keys(4, 3)], lease_from=0)  # 6 asked, 1 left in budget
        assert [len(o) for o in first.offsets] == [3] and second.lease == 0
        counters = worker.info()["counters"]
        assert counters["lease.over_budget"] == 1 and counters["load.chunks"] == 2  # counters rode along
        another = StoreClient(load_config(raw))  # the same user's: the same budget, not a new one
        assert [len(o) for o in another.lookup([_keys(4, 3)], lease_from=0).offsets] == [1]
        another.close()
        scheduler.close()  # its pins go with it (once the service sees the connection end)
        deadline = time.monotonic() + 10
        while sum(_put(worker, _keys(40, SLOTS))) < SLOTS and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.residency(_keys(1, 3))[1] == 0
    finally:
        worker.close()
        stop_service(raw)


def test_a_client_that_may_not_map_the_tier_gets_no_lease(tmp_path):
    raw = service_config(tmp_path, dram=SLOTS * record_bytes(CHUNK), share_dram="off")
    worker = StoreClient(load_config(raw), CHUNK)
    try:
        assert _put(worker, _keys(1, 2)) == [True] * 2
        found = StoreClient(load_config(raw)).lookup([_keys(1, 2)], lease_from=0)
        assert (found.resident, found.lease, found.offsets) == (2, 0, ())
    finally:
        worker.close()
        stop_service(raw)


# -- disk hits verified as they are copied out (one pass over their bytes) ------------------


def _on_disk(tmp_path, disk_dir, keys: list[bytes]) -> dict:
    """A service whose disk tier holds `keys` and whose DRAM tier holds none of them."""
    raw = service_config(tmp_path, dram=SLOTS * record_bytes(CHUNK), disk_dir=disk_dir, disk="8MiB")
    writer = StoreClient(load_config(raw), CHUNK)
    assert _put(writer, keys) == [True] * len(keys)
    writer.close()
    stop_service(raw)  # DRAM's chunks go down to disk; the next client starts a service anew
    return raw


def test_a_disk_hit_verified_by_its_reader_is_published_on_its_word_only(tmp_path, disk_dir):
    """Pin(verify=False): the disk hits land in DRAM slots unpublished, each with the
    checksum its bytes must have; the reader's unpin publishes those it names good, drops
    and counts those it names bad (their disk records too), and puts back the ones it
    named neither (a reader that failed half-way publishes nothing it did not check)."""
    keys = _keys(1, 3)
    raw = _on_disk(tmp_path, disk_dir, keys)
    client = StoreClient(load_config(raw), CHUNK)
    try:
        lease, offsets, checks = client.pin(keys, verify=False)
        assert all(o >= 0 for o in offsets) and all(isinstance(c, int) for c in checks)
        assert [xxhash.xxh3_64_intdigest(bytes(client.memory.tier_payload(o))) for o in offsets] == checks
        assert client.residency(keys) == (3, 0, False)  # in DRAM, but not published
        client.unpin([lease], good=keys[:1], bad=keys[1:2])
        assert client.residency(keys[:1]) == (1, 1, False)  # promoted on the reader's word
        assert client.residency(keys[1:2])[0] == 0  # dropped: DRAM and disk
        assert client.residency(keys[2:]) == (1, 0, False)  # back on disk only, to be read again
        assert client.info()["counters"]["disk.miss.bad_checksum"] == 1
    finally:
        client.close()
        stop_service(raw)


def test_a_flipped_byte_found_as_it_is_copied_fails_its_blocks_and_leaves_the_store(tmp_path, disk_dir):
    """A worker loads disk hits verifying them as it copies them into KV blocks: the chunk
    whose record has a byte flipped on disk is a failed load (its blocks reported, the
    engine recomputes them), counted, dropped from the store; the other is loaded, byte for
    byte, and promoted into DRAM for the next load."""
    caches = {"layer": torch.zeros(32, 4, 16, 32, dtype=torch.float16)}
    layout = PagedKVLayout(caches, 32, 16)
    payloads = [np.random.default_rng(i).integers(0, 256, CHUNK, dtype=np.uint8) for i in (1, 2)]
    keys = _keys(1, 2)
    raw = service_config(tmp_path, dram=SLOTS * record_bytes(CHUNK), disk_dir=disk_dir, disk="8MiB")
    writer = StoreClient(load_config(raw), CHUNK)
    for slot, payload in enumerate(payloads):
        writer.memory.slot(slot)[:] = payload.tobytes()
    assert writer.put(keys, [0, 1]) == [True, True]
    writer.close()
    stop_service(raw)
    corrupt_record(os.path.join(disk_dir, "disk"), key=keys[1])
    worker = WorkerCore(layout, 0, partial(StoreClient, load_config(raw), CHUNK))
    try:
        assert worker.loads.link.get() is not None
        worker.start_loads([Transfer("r", (tuple(keys),), (None,), (tuple(range(16)), tuple(range(16, 32))),
                                     load_async=False)])
        assert worker.take_failed_blocks() == set(range(16, 32))
        assert worker.stats.snapshot()["load.bad_checksum"] == 1
        loaded = caches["layer"].view(torch.uint8).numpy().reshape(32, -1)
        assert np.array_equal(loaded[:16].reshape(-1), payloads[0])
        client = worker.loads.link.get()
        assert client is not None
        assert client.residency(keys) == (1, 1, False)  # the good one promoted, the bad one gone
        assert client.info()["counters"]["disk.miss.bad_checksum"] == 1
    finally:
        worker.close()
        stop_service(raw)
