"""Recovery after clean and unclean stops, torn records, a damaged checkpoint, duplicates."""

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from support.records import as_older_format
from support.stores import CHUNK_BYTES, disk_config, make_keys, make_payloads, read_back

from kvstore.cli import main as cli_main
from kvstore.devices.device import DATA_FILE
from kvstore.devices.layout import SB_COPIES, parse_superblock
from kvstore.format.record import (
    BLOCK,
    HEADER_BLOCK,
    MAGIC,
    HeaderState,
    pack_header,
    parse_header,
    record_bytes,
)
from kvstore.io.faulty import Fault
from kvstore.store.tiered import TieredStore

SLOT = record_bytes(CHUNK_BYTES)


def test_clean_restart_uses_the_checkpoint(disk_dir, engine, store_factory):
    config = disk_config(disk_dir, 32 * SLOT, engine)
    keys, payloads = make_keys(10), make_payloads(10)
    store = store_factory(config)
    store.put_many(keys, payloads)
    store.close()
    reopened = store_factory(config)
    assert reopened.probe.recovery()["from_checkpoint"] == 1 and reopened.probe.recovery()["records"] == 10
    ok, outs = read_back(reopened, keys)
    assert all(ok) and all(np.array_equal(o, p) for o, p in zip(outs, payloads, strict=True))


def test_unclean_restart_scans_and_new_writes_win(disk_dir, store_factory):
    config = disk_config(disk_dir, 32 * SLOT)
    keys, payloads = make_keys(6), make_payloads(6)
    store = store_factory(config)
    store.put_many(keys, payloads)
    store.simulate_crash()
    reopened = store_factory(config)
    assert reopened.probe.recovery()["scanned"] == 1 and reopened.probe.recovery()["records"] == 6
    assert all(read_back(reopened, keys)[0])
    assert reopened.put_many(make_keys(2, seed=9), make_payloads(2, seed=9)) == [True, True]


@pytest.mark.parametrize("clean", [True, False], ids=["after a clean stop", "after a crash"])
def test_a_tier_an_older_kvstore_left_starts_empty_and_its_records_are_never_read(disk_dir, store_factory,
                                                                                  clean, caplog):
    """Key format 1 (xxh3) records are of keys this version never computes: the tier they
    lie in is formatted anew, nothing of it indexed or served, and the store serves; a
    record of the older format found anyhow (a scan) never parses as a record."""
    config = disk_config(disk_dir, 32 * SLOT)
    keys, payloads = make_keys(6), make_payloads(6)
    store = store_factory(config)
    store.put_many(keys, payloads)
    store.close() if clean else store.simulate_crash()
    assert as_older_format(disk_dir) == 6
    with open(os.path.join(disk_dir, DATA_FILE), "rb") as f:
        assert parse_superblock(f.read(BLOCK))[1] is None  # not this version's
    reopened = store_factory(config)
    assert reopened.probe.recovery()["records"] == 0 and not any(read_back(reopened, keys)[0])
    assert "formatted by an older kvstore" in caplog.text
    with open(os.path.join(disk_dir, DATA_FILE), "rb") as f:
        superblock = parse_superblock(f.read(BLOCK))[1]
        assert superblock is not None
        f.seek(superblock.data_offset)
        assert parse_header(f.read(HEADER_BLOCK))[0] is HeaderState.TORN  # the old record, unread
    assert reopened.put_many(keys[:2], payloads[:2]) == [True, True] and all(read_back(reopened, keys[:2])[0])


CHILD = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, {tests!r})
    from support.stores import make_keys, disk_config
    from kvstore.store.tiered import TieredStore
    store = TieredStore(disk_config({path!r}, {capacity}, {engine!r}), {chunk})
    keys = make_keys(4000)
    for i in range(0, 4000, 4):
        store.put_many(keys[i:i + 4], [np.full({chunk}, (j * 7) % 251, np.uint8)
                                       for j in range(i, i + 4)], parent=keys[i - 1] if i else None)
        print(i + 4, flush=True)
""")


def test_kill_9_during_writes_then_recovery(disk_dir, engine, store_factory):
    capacity = 400 * SLOT  # smaller than what the child writes: eviction runs too
    script = CHILD.format(tests=os.path.dirname(__file__), path=disk_dir, capacity=capacity,
                          engine=engine, chunk=CHUNK_BYTES)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    written = 0
    deadline = time.monotonic() + 60
    while written < 600 and time.monotonic() < deadline:
        line = child.stdout.readline()
        if not line:
            break
        written = int(line)
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    assert written >= 600, "the child never got going"
    store = store_factory(disk_config(disk_dir, capacity, engine))
    assert store.probe.recovery()["scanned"] == 1
    keys = make_keys(4000)
    present = [i for i, k in enumerate(keys) if store.contains(k)]
    assert len(present) > 100
    ok, outs = read_back(store, [keys[i] for i in present])
    for i, served, out in zip(present, ok, outs, strict=True):
        if served:  # every record served is exactly what was written
            assert (out == (i * 7) % 251).all()
    assert sum(ok) >= len(present) - 8  # at most the writes in flight were torn
    newest = [i for i in range(written - 4, written)]
    assert all(store.contains(keys[i]) for i in newest)  # acknowledged writes survived


def test_torn_header_is_detected_and_its_slot_reused(disk_dir, store_factory):
    config = disk_config(disk_dir, 8 * SLOT)
    store = store_factory(config)
    slots = store.probe.capacity("disk")
    keys = make_keys(slots)
    store.put_many(keys, make_payloads(slots))
    data_offset, path = store.probe.devices()[0].data_offset, store.probe.devices()[0].path
    store.simulate_crash()
    with open(path, "r+b") as raw:  # a header write cut short: magic, then garbage
        raw.seek(data_offset + 2 * SLOT)
        raw.write(MAGIC + b"\x01" * 60)
    reopened = store_factory(config)
    assert (reopened.probe.recovery()["records"], reopened.probe.recovery()["torn"]) == (slots - 1, 1)
    assert not reopened.contains(keys[2])
    new_key, new_payload = make_keys(1, seed=5), make_payloads(1, seed=5)
    assert reopened.put_many(new_key, new_payload) == [True]
    assert reopened.stats.snapshot().get("disk.evictions", 0) == 0  # it took the torn slot


def test_fsck_reports_valid_corrupt_torn(disk_dir, store_factory, capsys):
    store = store_factory(disk_config(disk_dir, 8 * SLOT))
    store.put_many(make_keys(3), make_payloads(3))
    data_offset, path = store.probe.devices()[0].data_offset, store.probe.devices()[0].path
    store.close()
    assert cli_main(["fsck", disk_dir, "--json"]) == 0
    assert '"valid": 3, "corrupt": 0' in capsys.readouterr().out
    with open(path, "r+b") as raw:
        raw.seek(data_offset + SLOT + 4096 + 100)  # a payload byte of slot 1
        raw.write(b"\xff\xfe")
        raw.seek(data_offset + 2 * SLOT + 20)  # a header byte of slot 2
        raw.write(b"\x00\x01")
    assert cli_main(["fsck", disk_dir, "--json"]) == 1
    out = capsys.readouterr().out
    assert '"valid": 1, "corrupt": 1, "torn": 1' in out


@pytest.mark.slow
def test_recovery_of_100k_records(disk_dir, store_factory):
    """Prints scan and checkpoint recovery times for 100k records (docs/benchmarks.md)."""
    chunk, count = 4096, 100_000
    config = disk_config(disk_dir, (count + 64) * record_bytes(chunk) + (8 << 20), "uring")
    config["io"]["queue_depth"] = 64
    store = store_factory(config, chunk_bytes=chunk)
    keys = make_keys(count)
    payload = [np.full(chunk, 7, np.uint8)] * 1000
    for start in range(0, count, 1000):
        store.put_many(keys[start:start + 1000], payload)
    store.close()
    by_checkpoint = store_factory(config, chunk_bytes=chunk)
    recovered = by_checkpoint.probe.recovery()
    assert recovered["records"] == count and recovered["from_checkpoint"]
    by_checkpoint.simulate_crash()  # leave it dirty: the next open must scan
    by_scan = store_factory(config, chunk_bytes=chunk)
    assert by_scan.probe.recovery()["records"] == count and by_scan.probe.recovery()["scanned"] == 1
    print(f"\nrecovery of {count} records: checkpoint {by_checkpoint.probe.recovery()['seconds']:.3f} s, "
          f"header scan {by_scan.probe.recovery()['seconds']:.3f} s")


def test_clean_close_writes_dram_chunks_down(disk_dir):
    """A restart loses DRAM, not what DRAM held: close writes it to disk first."""
    config = {"tiers": {"dram": {"capacity": "4MiB"},
                        "disk": [{"path": disk_dir, "capacity": "16MiB"}]}}
    keys, payloads = make_keys(5), make_payloads(5)
    with TieredStore(config, CHUNK_BYTES) as store:
        assert store.put_many(keys, payloads) == [True] * 5
        assert store.info()["tiers"][1]["chunks"] == 0  # nothing evicted yet: DRAM only
    with TieredStore(config, CHUNK_BYTES) as store:
        assert store.lookup(keys).tiers == ("disk",) * 5
        found, outs = read_back(store, keys)
        assert found == [True] * 5
        assert all(np.array_equal(out, payload) for out, payload in zip(outs, payloads, strict=True))


def test_a_corrupted_checkpoint_falls_back_to_a_scan(disk_dir, store_factory):
    config = disk_config(disk_dir, 32 * SLOT)
    keys, payloads = make_keys(5), make_payloads(5)
    store = store_factory(config)
    store.put_many(keys, payloads)
    store.close()
    with open(os.path.join(disk_dir, "kvstore.data"), "r+b") as raw:
        raw.seek(SB_COPIES * BLOCK + 20)  # inside the first checkpoint entry
        raw.write(b"\xee\xee")
    reopened = store_factory(config)
    assert (reopened.probe.recovery()["from_checkpoint"], reopened.probe.recovery()["scanned"]) == (0, 1)
    ok, outs = read_back(reopened, keys)
    assert all(ok) and all(np.array_equal(o, p) for o, p in zip(outs, payloads, strict=True))


def test_the_newest_copy_of_a_key_wins_and_the_older_is_zeroed(disk_dir, store_factory):
    """A crash between writing a newer copy of a key and dropping the old one leaves two
    valid records of it: the scan keeps the higher sequence number and zeroes the other."""
    from kvstore.store.fsck import fsck

    config = disk_config(disk_dir, 32 * SLOT)
    keys, payloads = make_keys(2), make_payloads(2)
    store = store_factory(config)
    store.put_many(keys, payloads)
    old_offset, (device,) = store.probe.where(keys[0]).offset, store.probe.devices()
    assert old_offset is not None and device.data_offset is not None
    new_offset = device.data_offset + (store.probe.capacity("disk") - 1) * SLOT  # a free slot
    store.simulate_crash()
    with open(os.path.join(disk_dir, "kvstore.data"), "r+b") as raw:
        raw.seek(old_offset)
        image = bytearray(raw.read(SLOT))
        header = parse_header(image)[1]
        pack_header(dataclasses.replace(header, seq=header.seq + 100), memoryview(image))
        raw.seek(new_offset)
        raw.write(image)
    reopened = store_factory(config)
    assert (reopened.probe.recovery()["records"], reopened.probe.recovery()["stale"]) == (2, 1)
    assert reopened.probe.where(keys[0]).offset == new_offset
    assert all(read_back(reopened, keys)[0])
    reopened.close()
    assert fsck(disk_dir)["valid"] == 2  # the older copy's header is gone


def test_a_delete_whose_header_zeroing_fails_keeps_the_record(disk_dir, faulty, store_factory):
    config = disk_config(disk_dir, 32 * SLOT)
    keys, payloads = make_keys(2), make_payloads(2)
    store = store_factory(config, engine=faulty)
    store.put_many(keys, payloads)
    faulty.add(Fault("error", reads=False, writes=True, remaining=1))
    assert store.delete(keys[:1]) == 0
    assert store.stats.snapshot()["disk.delete_failed"] == 1
    assert store.contains(keys[0])  # indexed as it is on disk: a restart would find it too
    assert store.delete(keys[:1]) == 1 and not store.contains(keys[0])
    store.close()
    assert not store_factory(config).contains(keys[0])
