import threading

import numpy as np
import pytest
import torch
from support import faults
from support.cluster import wait_for
from support.stores import CHUNK_BYTES, disk_config, make_keys, make_payloads, read_back

from kvstore.format.errors import ConfigError, DeviceError, ShapeError
from kvstore.format.record import record_bytes
from kvstore.io.faulty import Fault
from kvstore.store.tiered import TieredStore

SLOT = record_bytes(CHUNK_BYTES)


def test_host_only_round_trip_with_torch_buffers(store_factory):
    store = store_factory({"tiers": {"dram": {"capacity": 8 * SLOT}}})
    keys, payloads = make_keys(4), make_payloads(4)
    assert store.put_many(keys, [torch.from_numpy(p) for p in payloads]) == [True] * 4
    outs = [torch.zeros(CHUNK_BYTES, dtype=torch.uint8) for _ in keys]
    assert store.get_many(keys, outs) == [True] * 4
    assert all(np.array_equal(o.numpy(), p) for o, p in zip(outs, payloads, strict=True))
    assert store.lookup(keys).tiers == ("dram",) * 4


def test_disk_only_round_trip_both_engines(disk_dir, engine, store_factory):
    store = store_factory(disk_config(disk_dir, 40 * SLOT, engine))
    keys, payloads = make_keys(20), make_payloads(20)
    assert all(store.put_many(keys, payloads))
    ok, outs = read_back(store, keys)
    assert all(ok)
    assert all(np.array_equal(o, p) for o, p in zip(outs, payloads, strict=True))
    assert store.info()["io_engine"] == engine


def test_dram_victims_go_down_to_disk_and_come_back_up(disk_dir, engine, store_factory):
    store = store_factory(disk_config(disk_dir, 64 * SLOT, engine, dram=4 * SLOT))
    keys, payloads = make_keys(12), make_payloads(12)
    for start in range(0, 12, 2):
        assert all(store.put_many(keys[start:start + 2], payloads[start:start + 2],
                                  parent=keys[start - 1] if start else None))
        assert store.flush(10)
    counters = store.stats.snapshot()  # ahead of the puts by the cleaner, or their own chunks directly
    assert counters.get("dram.cleaned", 0) + counters.get("put.straight_to_disk", 0) >= 8
    assert store.lookup(keys).count == 12
    ok, outs = read_back(store, keys)
    assert all(ok) and all(np.array_equal(o, p) for o, p in zip(outs, payloads, strict=True))
    assert store.stats.snapshot()["disk.hits"] >= 8
    assert "dram" in store.lookup(keys).tiers  # promoted on the way up


def test_lookup_counts_the_leading_run_only(store_factory):
    store = store_factory({"tiers": {"dram": {"capacity": 16 * SLOT}}})
    keys, payloads = make_keys(6), make_payloads(6)
    store.put_many(keys[:2] + keys[3:], payloads[:2] + payloads[3:])
    assert store.lookup(keys).count == 2
    assert store.contains(keys[4]) and not store.contains(keys[2])


def test_delete_survives_restart(disk_dir, store_factory):
    config = disk_config(disk_dir, 16 * SLOT)
    store = store_factory(config)
    keys, payloads = make_keys(3), make_payloads(3)
    store.put_many(keys, payloads)
    assert store.delete([keys[1]]) == 1
    store.close()
    reopened = store_factory(config)
    assert [reopened.contains(k) for k in keys] == [True, False, True]


def test_a_disk_write_that_timed_out_and_lands_later_never_lands_on_another_record(
        disk_dir, faulty, store_factory):
    """A put's payload write times out (a slow device) and lands only after the next put
    reserved a slot: its slot is held until it lands, so the next put takes another and
    reads back whole, where it took the same slot (the free list's last) and the late
    payload overwrote it (a counted miss, its chunk lost)."""
    config = disk_config(disk_dir, 64 * SLOT)
    config["io"].update(timeout_s=0.3, breaker_threshold=1 << 20)
    store = store_factory(config, engine=faulty)
    keys, payloads = make_keys(2), make_payloads(2)
    late = faulty.add(Fault("late", reads=False, writes=True, remaining=1,
                            match=lambda request: request.write and request.nbytes == CHUNK_BYTES))
    assert store.put_many(keys[:1], payloads[:1]) == [False]  # its payload write timed out
    assert store.put_many(keys[1:], payloads[1:]) == [True]
    late.land()
    assert late.wait_landed(5)
    ok, outs = read_back(store, keys[1:])
    assert ok == [True] and np.array_equal(outs[0], payloads[1])
    assert store.put_many(keys[:1], payloads[:1]) == [True]  # the held slot is free again: reused
    assert read_back(store, keys)[0] == [True, True]


@pytest.mark.parametrize("reader", ["get", "prefetch"])
def test_a_delete_under_a_promotion_is_not_undone_by_it(disk_dir, store_factory, monkeypatch, reader):
    """A get (or a prefetch) reads a chunk from disk to promote it into DRAM; a delete of it
    runs while the read is verified and before it is published: the chunk is not published
    in DRAM, and after both it is in no tier, nor after a restart (it came back into DRAM,
    and from there onto disk at the close)."""
    from kvstore.datapath.landing import Landings

    config = disk_config(disk_dir, 64 * record_bytes(CHUNK_BYTES), dram=2 * record_bytes(CHUNK_BYTES))
    store = store_factory(config, background=False)
    keys, payloads = make_keys(4), make_payloads(4)
    assert store.put_many(keys, payloads) == [True] * 4
    key = next(k for k in keys if store.lookup([k]).tiers == ("disk",))
    deletes: list[threading.Thread] = []
    publish = Landings.publish

    def delete_meanwhile(self, landing, promoted, keep_pin=False):
        if promoted == key and not deletes:
            deletes.append(threading.Thread(target=store.delete, args=([key],)))
            deletes[0].start()
            wait_for(lambda: faults.being_deleted(store, key), 10, "the delete under way")
            deletes[0].join(0.5)  # it waits for this copy (not listed, it would end first)
        return publish(self, landing, promoted, keep_pin)

    monkeypatch.setattr(Landings, "publish", delete_meanwhile)
    if reader == "get":
        ok, outs = read_back(store, [key])
        assert ok == [True] and np.array_equal(outs[0], payloads[keys.index(key)])  # read before the delete
    else:
        assert store.prefetch([key]) == 0  # promoted nothing
    deletes[0].join(30)
    assert not deletes[0].is_alive()
    assert store.lookup([key]).count == 0
    store.close()
    assert store_factory(config, background=False).lookup([key]).count == 0


def test_capacity_is_never_exceeded_under_concurrent_writers(disk_dir, engine, store_factory):
    capacity = 24 * SLOT
    store = store_factory(disk_config(disk_dir, capacity, engine))
    errors = []

    def writer(seed: int) -> None:
        try:
            keys, payloads = make_keys(30, seed), make_payloads(30, seed)
            for start in range(0, 30, 3):
                store.put_many(keys[start:start + 3], payloads[start:start + 3])
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    info = store.info()["tiers"][0]
    assert info["used_bytes"] <= info["capacity_bytes"] <= capacity
    import os
    assert os.path.getsize(store.probe.devices()[0].path) <= capacity
    keys = [k for seed in range(4) for k in make_keys(30, seed)]
    present = [k for k in keys if store.contains(k)]
    assert len(present) == store.probe.capacity("disk")
    ok, _ = read_back(store, present)
    assert all(ok)


def test_wrong_buffer_sizes_are_refused_before_any_io(store_factory):
    store = store_factory({"tiers": {"dram": {"capacity": 4 * SLOT}}})
    with pytest.raises(ShapeError, match="buffer 0 has 10 bytes"):
        store.put_many(make_keys(1), [np.zeros(10, np.uint8)])
    with pytest.raises(ShapeError, match="2 keys but 1 buffers"):
        store.get_many(make_keys(2), [np.zeros(CHUNK_BYTES, np.uint8)])


def test_a_path_in_use_by_another_store_is_refused(disk_dir, store_factory):
    store_factory(disk_config(disk_dir, 8 * SLOT))
    with pytest.raises(DeviceError, match="in use by another kvstore process"):
        store_factory(disk_config(disk_dir, 8 * SLOT))


def test_changed_chunk_size_does_not_destroy_stored_data(disk_dir, store_factory):
    store = store_factory(disk_config(disk_dir, 16 * SLOT))
    store.put_many(make_keys(2), make_payloads(2))
    store.close()
    with pytest.raises(DeviceError, match="chunk size or capacity changed"):
        store_factory(disk_config(disk_dir, 16 * SLOT), chunk_bytes=2 * CHUNK_BYTES)
    assert store_factory(disk_config(disk_dir, 16 * SLOT)).lookup(make_keys(2)).count == 2


def test_missing_path_and_too_small_host_tier_are_clear(tmp_path, store_factory):
    with pytest.raises(DeviceError, match="does not exist"):
        store_factory(disk_config(str(tmp_path / "no" / "such" / "dir"), 8 * SLOT))
    with pytest.raises(ConfigError, match=r"tiers\.dram\.capacity"):
        store_factory({"tiers": {"dram": {"capacity": 4096}}})


def test_a_dram_slot_holding_another_key_is_a_counted_miss(store_factory):
    store = store_factory({"tiers": {"dram": {"capacity": 4 * SLOT}}})
    keys, payloads = make_keys(2), make_payloads(2)
    store.put_many(keys, payloads)
    faults.stray_write(store, keys[1], 16, bytes(16))  # a stray write into the slab
    ok, _ = read_back(store, keys)
    assert ok == [True, False]
    assert store.stats.snapshot()["dram.miss.wrong_key"] == 1
    assert not store.contains(keys[1])


def test_prefetch_promotes_the_leading_disk_run_to_dram(disk_dir):
    config = disk_config(disk_dir, "16MiB", dram=4 << 20)
    keys, payloads = make_keys(6), make_payloads(6)
    with TieredStore(config, CHUNK_BYTES) as store:
        store.put_many(keys[:4], payloads[:4])
    with TieredStore(config, CHUNK_BYTES) as store:  # a restart: DRAM empty, disk recovered
        assert store.lookup(keys).tiers == ("disk",) * 4
        assert store.prefetch(keys) == 4
        assert store.lookup(keys).tiers == ("dram",) * 4
        found, outs = read_back(store, keys[:4])
        assert found == [True] * 4
        assert all(np.array_equal(o, p) for o, p in zip(outs, payloads[:4], strict=True))
        counters = store.stats.snapshot()
        assert counters["dram.hits"] == 4 and "disk.hits" not in counters
        assert store.prefetch(keys) == 0  # already in DRAM
