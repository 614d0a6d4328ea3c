"""The store's side of prefetch: promotion in capped waves, used and wasted
accounting, and a promotion whose reads fail (a miss later, never wrong data)."""

from __future__ import annotations

import errno
import threading
import time

import numpy as np
from support.stores import CHUNK_BYTES, make_keys, make_payloads, read_back

from kvstore.format.record import record_bytes
from kvstore.io import make_engine
from kvstore.io.faulty import Fault, FaultyEngine

SLOT = record_bytes(CHUNK_BYTES)


class RecordingEngine(FaultyEngine):
    """Passes everything through and remembers the bytes of each batch it was given."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.read_batches: list[int] = []

    def run(self, requests, timeout_s=None, on_complete=None):
        reads = sum(r.nbytes for r in requests if not r.write)
        if reads:
            self.read_batches.append(reads)
        return super().run(requests, timeout_s, on_complete)


def _on_disk_only(disk_dir, store_factory, engine, count, **extra):
    config = {"tiers": {"dram": {"capacity": 64 * SLOT}, "disk": [{"path": disk_dir, "capacity": 64 * SLOT}]},
              "io": {"queue_depth": 8, "timeout_s": 5}, **extra}
    keys, payloads = make_keys(count), make_payloads(count)
    first = store_factory(config, engine=engine)
    assert all(first.put_many(keys, payloads))
    first.close()  # DRAM's chunks go down to disk; the next store starts with DRAM empty
    return store_factory(config, engine=engine), keys, payloads


def test_prefetch_reads_in_waves_no_larger_than_the_cap(disk_dir, store_factory):
    engine = RecordingEngine(make_engine("auto", 8))
    store, keys, payloads = _on_disk_only(disk_dir, store_factory, engine, 12,
                                          prefetch_inflight=3 * SLOT)
    engine.read_batches.clear()
    assert store.prefetch(keys) == 12
    assert engine.read_batches and max(engine.read_batches) <= 3 * SLOT
    assert len(engine.read_batches) == 4
    assert store.lookup(keys).resident == 12
    ok, outs = read_back(store, keys)
    assert all(ok) and all(np.array_equal(o, p) for o, p in zip(outs, payloads, strict=True))
    counters = store.stats.snapshot()
    assert counters["prefetch.chunks"] == 12 and counters["prefetch.used"] == 12
    assert counters["dram.hits"] == 12 and "disk.hits" not in counters


def test_a_prefetched_chunk_evicted_unread_is_wasted(disk_dir, store_factory):
    engine = make_engine("auto", 8)
    store, keys, _ = _on_disk_only(disk_dir, store_factory, engine, 4)
    assert store.prefetch(keys[:2]) == 2
    # Fill DRAM with other chunks until the two are evicted, unread.
    others, other_payloads = make_keys(64, seed=3), make_payloads(64, seed=3)
    store.put_many(others, other_payloads)
    store.flush()
    counters = store.stats.snapshot()
    assert counters["prefetch.wasted_bytes"] == 2 * CHUNK_BYTES
    assert "prefetch.used" not in counters


def test_a_prefetch_whose_reads_fail_promotes_nothing_and_serves_nothing_wrong(disk_dir, store_factory):
    engine = FaultyEngine(make_engine("auto", 8))
    try:
        store, keys, payloads = _on_disk_only(disk_dir, store_factory, engine, 6)
        engine.add(Fault("error", error=errno.EIO, remaining=2))
        assert store.prefetch(keys) == 4
        found = store.lookup(keys)
        assert found.count < 6  # the two unreadable chunks left the index
        ok, outs = read_back(store, keys)
        assert sum(ok) == 4
        assert all(np.array_equal(o, p) for served, o, p in zip(ok, outs, payloads, strict=True) if served)
    finally:
        engine.release()


def test_the_services_promotions_take_each_user_in_turn_and_bound_each_users_queue(disk_dir, store_factory,
                                                                                    monkeypatch):
    """The service promotes one run at a time: a co-tenant that queued many runs delays the
    owner's next by one run at most (the users take turns), and past QUEUED_MOST waiting its
    runs are not promoted (counted), so neither its backlog nor its memory grows without end."""
    from kvstore.service import prefetches

    store, keys, _ = _on_disk_only(disk_dir, store_factory, make_engine("threads", 4), 8)
    monkeypatch.setattr(prefetches, "QUEUED_MOST", 3)
    promoted, running, held = [], threading.Event(), threading.Event()
    prefetch = store.prefetch

    def recorded(run):
        running.set()
        held.wait(10)  # the first run holds the thread while the others queue
        promoted.append(run)
        return prefetch(run)

    monkeypatch.setattr(store, "prefetch", recorded)
    service = prefetches.Prefetches()
    try:
        service.residency(store, [keys[0:1]], prefetch=True, uid=1000)
        assert running.wait(10)
        for i in range(1, 5):  # the co-tenant's next four: three wait, one is dropped
            service.residency(store, [keys[i : i + 1]], prefetch=True, uid=1000)
        service.residency(store, [keys[6:7]], prefetch=True, uid=0)  # then the owner's
        held.set()
        deadline = time.monotonic() + 10
        while len(promoted) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert promoted == [tuple(keys[0:1]), tuple(keys[6:7]), tuple(keys[1:2]), tuple(keys[2:3]),
                            tuple(keys[3:4])]
        assert store.stats.snapshot()["prefetch.dropped"] == 1
    finally:
        service.close()
