"""Every failure the hardware can produce is a counted miss: never wrong data, never a hang."""

import errno
import os
import time

import numpy as np
import pytest
from support import faults
from support.stores import CHUNK_BYTES, disk_config, make_keys, make_payloads, read_back

from kvstore.devices import layout
from kvstore.format.errors import DeviceError, ShapeError
from kvstore.format.record import record_bytes
from kvstore.io.faulty import Fault

SLOT = record_bytes(CHUNK_BYTES)


def _filled(disk_dir, faulty, store_factory, count=6, timeout_s=5.0):
    config = disk_config(disk_dir, 32 * SLOT)
    config["io"]["timeout_s"] = timeout_s
    store = store_factory(config, engine=faulty)
    keys, payloads = make_keys(count), make_payloads(count)
    assert all(store.put_many(keys, payloads))
    return store, keys, payloads


@pytest.mark.parametrize("kind,reason", [("error", "io_error"), ("short", "io_error")])
def test_read_faults_are_counted_misses(disk_dir, faulty, store_factory, kind, reason):
    store, keys, payloads = _filled(disk_dir, faulty, store_factory)
    faulty.add(Fault(kind, error=errno.EIO, remaining=2))
    ok, outs = read_back(store, keys)
    assert sum(ok) == len(keys) - 2
    for served, out, payload in zip(ok, outs, payloads, strict=True):
        if served:
            assert np.array_equal(out, payload)
    assert store.stats.snapshot()[f"disk.miss.{reason}"] == 2
    assert store.lookup(keys).count < len(keys)  # failed chunks are dropped, not retried forever


def test_torn_write_is_never_served(disk_dir, faulty, store_factory):
    config = disk_config(disk_dir, 32 * SLOT)
    store = store_factory(config, engine=faulty)
    keys, payloads = make_keys(3), make_payloads(3)
    # Tear the payload write of the second chunk; the engine reports success.
    faulty.add(Fault("torn_write", reads=False, writes=True, remaining=1,
                     match=lambda r: r.nbytes > 4096 and r.offset == _payload_offset(store, 1)))
    store.put_many(keys, payloads)
    ok, outs = read_back(store, keys)
    assert ok == [True, False, True]
    assert np.array_equal(outs[0], payloads[0]) and np.array_equal(outs[2], payloads[2])
    assert store.stats.snapshot()["disk.miss.bad_checksum"] == 1


def _payload_offset(store, nth_reserved: int) -> int:
    """Slots are handed out lowest first on a fresh device."""
    offset = faults.disk_offset(store, nth_reserved)
    return offset + 4096


def test_slow_device_still_serves(disk_dir, faulty, store_factory):
    store, keys, payloads = _filled(disk_dir, faulty, store_factory)
    faulty.add(Fault("latency", delay_s=0.2))
    ok, outs = read_back(store, keys)
    assert all(ok) and all(np.array_equal(o, p) for o, p in zip(outs, payloads, strict=True))


def test_a_hung_read_becomes_a_miss_within_the_deadline(disk_dir, faulty, store_factory):
    store, keys, _ = _filled(disk_dir, faulty, store_factory, timeout_s=0.5)
    faulty.add(Fault("hang", remaining=1))
    started = time.monotonic()
    ok, _ = read_back(store, keys)
    assert time.monotonic() - started < 5
    assert sum(ok) == len(keys) - 1
    assert store.stats.snapshot()["disk.miss.timeout"] == 1


def test_a_buffer_a_late_read_may_still_land_in_is_not_read_into_until_it_lands(
        disk_dir, faulty, store_factory):
    """Reads land straight in `store.buffers()`; one whose read missed its deadline could
    still be written by the device, so a get into it is refused, by name, until it lands."""
    store, keys, payloads = _filled(disk_dir, faulty, store_factory, timeout_s=0.5)
    buffers = store.buffers(2)
    late = faulty.add(Fault("late", remaining=1, match=lambda r: r.nbytes > 4096))
    assert store.get_many(keys[:2], buffers) == [False, True]
    with pytest.raises(ShapeError, match="buffer 0 is still lent to a read that missed its deadline"):
        store.get_many(keys[2:4], buffers)
    fresh = store.buffers(2)
    assert store.get_many(keys[2:4], fresh) == [True, True]
    assert all(np.array_equal(np.frombuffer(b, np.uint8), p)
               for b, p in zip(fresh, payloads[2:4], strict=True))
    late.land()  # the device writes chunk 0 into buffer 0, late
    assert late.wait_landed(10)
    assert store.get_many(keys[2:4], buffers) == [True, True]
    assert all(np.array_equal(np.frombuffer(b, np.uint8), p)
               for b, p in zip(buffers, payloads[2:4], strict=True))


def test_failed_disk_write_is_not_published(disk_dir, faulty, store_factory):
    store = store_factory(disk_config(disk_dir, 32 * SLOT), engine=faulty)
    faulty.add(Fault("error", reads=False, writes=True, error=errno.ENOSPC, remaining=1))
    keys = make_keys(2)
    assert store.put_many(keys, make_payloads(2)) == [False, True]  # the first write fails
    assert [store.contains(k) for k in keys] == [False, True]
    assert store.stats.snapshot()["disk.miss.io_error"] == 1


def test_bit_rot_on_disk_is_a_counted_miss(disk_dir, engine, store_factory):
    store = store_factory(disk_config(disk_dir, 16 * SLOT, engine))
    keys, payloads = make_keys(2), make_payloads(2)
    store.put_many(keys, payloads)
    place = store.probe.where(keys[1])
    assert place.device is not None and place.offset is not None
    with open(place.device, "r+b") as raw:
        raw.seek(place.offset + 4096 + 12345)
        raw.write(b"\x00\xff\x00")
    ok, _outs = read_back(store, keys)
    assert ok == [True, False]
    assert store.stats.snapshot()["disk.miss.bad_checksum"] == 1


def test_a_miss_names_the_device_the_chunk_was_on(tmp_path, engine, store_factory, caplog):
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    store = store_factory({"tiers": {"disk": [{"path": p, "capacity": 8 * SLOT} for p in paths]},
                           "io": {"engine": engine, "queue_depth": 4}})
    keys = make_keys(2)
    store.put_many(keys, make_payloads(2))
    second = store.probe.where(keys[1])  # striped: chunk 1 is on the second path
    assert second.device == store.probe.devices()[1].path and second.offset is not None
    with open(second.device, "r+b") as raw:
        raw.seek(second.offset + 4096 + 7)
        raw.write(b"\xaa")
    with caplog.at_level("WARNING"):
        assert read_back(store, keys)[0] == [True, False]
    assert second.device in caplog.text


def test_a_superblock_read_past_its_deadline_is_an_error_naming_it(disk_dir, faulty, store_factory):
    """The one superblock reader (own devices, revalidation, peers' devices); its buffer,
    like any, is the late read's until it lands (test_io_ownership.py)."""
    store = store_factory(disk_config(disk_dir, 16 * SLOT))
    path = store.probe.devices()[0].path
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        faulty.add(Fault("hang", remaining=1))
        with pytest.raises(DeviceError, match="superblock read did not finish within its deadline"):
            layout.read_superblocks(faulty, fd, path, 0.2)
        copies = layout.read_superblocks(faulty, fd, path, 5.0)  # the device answers again
        assert all(sb is not None for _, sb in copies)
    finally:
        os.close(fd)
