"""A failing device costs only its own chunks, within a deadline, and comes back verified.

Faults are injected by the FaultyEngine on one device's file descriptor; every
other request is real O_DIRECT I/O.
"""

import errno
import logging
import os
import threading
import time

import numpy as np
import pytest
from support import faults
from support.stores import CHUNK_BYTES, make_keys, make_payloads, read_back

from kvstore.devices.health import IN_SERVICE, TRIPPED, DeviceHealth
from kvstore.devices.watch import DeviceWatch
from kvstore.format.malformed import MalformedCounts
from kvstore.format.record import record_bytes
from kvstore.io.faulty import Fault
from kvstore.service.purge_file import PendingPurges

SLOT = record_bytes(CHUNK_BYTES)


def _config(disk_dir, timeout_s=5.0) -> dict:
    """A disk tier striped over two devices, a breaker that trips at 2 faults in a row."""
    paths = [os.path.join(disk_dir, name) for name in ("a", "b")]
    return {"tiers": {"disk": [{"path": p, "capacity": 32 * SLOT} for p in paths]},
            "io": {"queue_depth": 8, "timeout_s": timeout_s, "breaker_threshold": 2,
                   "breaker_cooldown_s": 30}}


def _two_devices(disk_dir, faulty, store_factory, timeout_s=5.0, count=8, cooldown_passed=True):
    config = _config(disk_dir, timeout_s)
    # The test drives the monitor's check itself (TieredStore.step), deterministically, on a clock
    # that is already past every cooldown unless the test is about the cooldown.
    store = store_factory(config, engine=faulty, background=False)
    if cooldown_passed:
        faults.monitor_clock(store, lambda: time.monotonic() + 3600)
    keys, payloads = make_keys(count), make_payloads(count)
    assert all(store.put_many(keys, payloads))
    return store, keys, payloads


def _device_of(store, key) -> int:
    return [device.path for device in store.probe.devices()].index(store.probe.where(key).device)


def _served_match(ok, outs, payloads):
    return all(np.array_equal(out, p) for served, out, p in zip(ok, outs, payloads, strict=True) if served)


@pytest.mark.parametrize("error", [errno.EIO, errno.ENOLINK, errno.ENODEV, errno.ENXIO, errno.ETIMEDOUT])
def test_breaker_trips_on_one_device_and_revalidation_brings_it_back(disk_dir, faulty, store_factory,
                                                                     error):
    store, keys, payloads = _two_devices(disk_dir, faulty, store_factory)
    on_a = [i for i, k in enumerate(keys) if _device_of(store, k) == 0]
    assert len(on_a) == 4  # striped: half the chunks on each device
    faulty.add(Fault("error", error=error, match=faults.on_device(store, 0)))

    ok, outs = read_back(store, keys)
    assert [i for i, served in enumerate(ok) if not served] == on_a
    assert _served_match(ok, outs, payloads)
    health = store.probe.devices()[0]
    assert health.state == TRIPPED and health.trips == 1
    assert store.probe.devices()[1].state == IN_SERVICE
    counters = store.stats.snapshot()
    assert counters["disk.trips"] == 1
    # Device b's chunks are still served; device a's are misses without any I/O.
    injected = faulty.injected
    ok, outs = read_back(store, keys)
    assert sum(ok) == 4 and _served_match(ok, outs, payloads) and faulty.injected == injected
    assert store.put_many(make_keys(2, seed=9), make_payloads(2, seed=9)) == [True, True]
    assert all(_device_of(store, k) == 1 for k in make_keys(2, seed=9))  # nothing placed on a

    store.step()  # still failing: the superblock read fails, a stays out
    health = store.probe.devices()[0]
    assert health.state == TRIPPED and "revalidation failed" in health.reason

    faulty.clear()
    store.step()
    assert store.probe.devices()[0].state == IN_SERVICE
    ok, outs = read_back(store, keys)
    assert all(ok) and _served_match(ok, outs, payloads)
    assert store.stats.snapshot()["disk.revalidated_chunks"] == 4  # the faults removed 0 of a's


@pytest.mark.parametrize("how", ["delete", "purge"])
def test_a_delete_while_a_device_is_out_is_not_undone_by_its_return(disk_dir, faulty, store_factory, how):
    """A delete, or a purge of the chunks' namespace, while a device is out of service
    cannot reach its records: when it comes back they are zeroed, not served again (its
    revalidation read them back, and a restart would have too)."""
    store, keys, _ = _two_devices(disk_dir, faulty, store_factory)
    on_a = [k for k in keys if _device_of(store, k) == 0]
    faulty.add(Fault("error", match=faults.on_device(store, 0)))
    read_back(store, on_a)  # a fault each: the breaker trips
    assert store.probe.devices()[0].state == TRIPPED
    if how == "delete":
        store.delete(on_a[:2])
        gone = on_a[:2]
    else:
        assert store.admin.purge([bytes(16)], dry_run=False)["removed"] == 4  # device b's; a's on its return
        gone = keys
    faulty.clear()
    store.step()
    assert store.probe.devices()[0].state == IN_SERVICE
    assert [store.lookup([k]).count for k in gone] == [0] * len(gone)
    assert store.stats.snapshot()["disk.deleted_while_out"] == len(gone) - (4 if how == "purge" else 0)
    kept = [k for k in keys if k not in gone]
    assert read_back(store, kept)[0] == [True] * len(kept)
    store.close()
    again = store_factory(_config(disk_dir), engine=faulty, background=False)
    assert [again.lookup([k]).count for k in gone] == [0] * len(gone)


def test_a_purge_a_device_out_has_not_seen_is_run_again_after_a_restart(disk_dir, faulty, store_factory,
                                                                       tmp_path):
    """A purge while a device is out of service, then a restart before it comes back: the
    device is scanned at the next start (out at the close, it has no checkpoint) and would
    serve the purged records again. The service keeps the pending purge in its file
    (service/purge_file.py) and runs it on the store it opens, before any client has it."""
    socket = str(tmp_path / "kvstore.sock")
    malformed = MalformedCounts(logging.getLogger("test"))
    store, keys, _ = _two_devices(disk_dir, faulty, store_factory)
    on_a = [k for k in keys if _device_of(store, k) == 0]
    faulty.add(Fault("error", match=faults.on_device(store, 0)))
    read_back(store, on_a)
    assert store.probe.devices()[0].state == TRIPPED
    report = PendingPurges(socket, malformed).purge(store, [bytes(16)], dry_run=False)
    assert report["removed"] == len(keys) - len(on_a) and report["pending"] == 1
    store.close()
    faulty.clear()
    again = store_factory(_config(disk_dir), engine=faulty, background=False)
    assert again.lookup(on_a).count == len(on_a)  # what a restart alone serves again
    PendingPurges(socket, malformed).opened(again)
    assert [again.lookup([k]).count for k in keys] == [0] * len(keys)
    assert not os.path.exists(socket + ".purges")  # nothing pending: every device serves


def test_a_delete_during_a_returning_devices_scan_is_not_undone(disk_dir, faulty, store_factory, monkeypatch):
    """A delete that comes while a returning device's headers are being re-read (it cannot
    reach them yet, and the scan has passed its record): the revalidation scans again,
    so the record is zeroed, not served."""
    import kvstore.tiers.availability as availability

    store, keys, _ = _two_devices(disk_dir, faulty, store_factory)
    on_a = [k for k in keys if _device_of(store, k) == 0]
    faulty.add(Fault("error", match=faults.on_device(store, 0)))
    read_back(store, on_a)
    assert store.probe.devices()[0].state == TRIPPED
    faulty.clear()
    scan, scans = availability.scan_group, []

    def scan_then_delete(*args, **kwargs):
        scans.append(1)
        result = scan(*args, **kwargs)
        if len(scans) == 1:
            store.delete(on_a[:1])  # a client's, while what the scan found is not served yet
        return result

    monkeypatch.setattr(availability, "scan_group", scan_then_delete)
    store.step()
    assert store.probe.devices()[0].state == IN_SERVICE and len(scans) == 2
    assert store.lookup(on_a[:1]).count == 0
    assert read_back(store, on_a[1:])[0] == [True] * (len(on_a) - 1)


def test_a_hung_device_costs_a_deadline_once_then_misses_at_once(disk_dir, faulty, store_factory):
    store, keys, payloads = _two_devices(disk_dir, faulty, store_factory, timeout_s=0.5)
    faulty.add(Fault("hang", match=faults.on_device(store, 0)))
    started = time.monotonic()
    ok, outs = read_back(store, keys)
    first = time.monotonic() - started
    assert sum(ok) == 4 and _served_match(ok, outs, payloads)
    assert first < 5, f"a get took {first:.1f} s past a 0.5 s deadline"
    assert store.probe.devices()[0].state == TRIPPED
    started = time.monotonic()
    ok, _ = read_back(store, keys)
    assert sum(ok) == 4 and time.monotonic() - started < first  # no second deadline


def test_a_write_in_flight_to_a_lost_device_is_never_served(disk_dir, faulty, store_factory):
    store, _, _ = _two_devices(disk_dir, faulty, store_factory, count=2)
    on_a, sent = faults.on_device(store, 0), threading.Event()
    faulty.add(Fault("latency", reads=False, writes=True, delay_s=3,
                     match=lambda request: on_a(request) and (sent.set() or True)))
    keys, payloads = make_keys(2, seed=5), make_payloads(2, seed=5)
    result = {}
    writer = threading.Thread(target=lambda: result.update(stored=store.put_many(keys, payloads)))
    writer.start()
    assert sent.wait(10)  # the write to device a is now in flight
    faults.controller_lost(store, 0, "test: controller lost")
    writer.join(timeout=10)
    assert not writer.is_alive()
    faulty.clear()
    lost = [k for k in keys if store.lookup([k]).count == 0]
    assert len(lost) == 1  # the chunk striped onto device a
    assert store.stats.snapshot()["disk.write_dropped_device_lost"] == 1
    assert faults.revalidate(store, 0)
    # Its bytes did land, but its header was zeroed before the device served again.
    assert store.lookup(lost).count == 0
    ok, _ = read_back(store, lost)
    assert ok == [False]


def test_an_offline_device_gets_no_checkpoint_and_is_scanned_next_time(disk_dir, faulty, store_factory):
    store, keys, payloads = _two_devices(disk_dir, faulty, store_factory)
    faults.controller_lost(store, 0, "test")
    store.close()
    reopened = store_factory(_config(disk_dir), engine=faulty)
    assert reopened.probe.recovery()["from_checkpoint"] == 1 and reopened.probe.recovery()["scanned"] == 1
    ok, outs = read_back(reopened, keys)
    assert all(ok) and _served_match(ok, outs, payloads)


def test_a_timed_out_promotion_reuses_its_dram_slot_only_once_the_read_lands(disk_dir, faulty,
                                                                             store_factory):
    config = {"tiers": {"dram": {"capacity": 8 * SLOT}, "disk": [{"path": disk_dir, "capacity": 32 * SLOT}]},
              "io": {"queue_depth": 8, "timeout_s": 0.3, "breaker_threshold": 100}}
    keys, payloads = make_keys(2), make_payloads(2)
    first = store_factory(config, engine=faulty)
    assert all(first.put_many(keys, payloads))
    first.close()  # DRAM's chunks go down to disk
    store = store_factory(config, engine=faulty)
    faulty.add(Fault("hang", remaining=2))
    ok, _ = read_back(store, keys)
    assert ok == [False, False]
    # The two DRAM slots the reads were aimed at stay pinned: no new record can land there
    # while the kernel might still write into them.
    assert store.probe.pinned() == 2
    faulty.release()  # they land (untouched)
    assert store.probe.pinned() == 0
    ok, outs = read_back(store, keys)
    assert all(ok) and _served_match(ok, outs, payloads)


def test_a_tripped_device_waits_out_its_cooldown_before_revalidation(disk_dir, faulty, store_factory):
    store, keys, _ = _two_devices(disk_dir, faulty, store_factory, cooldown_passed=False)
    faulty.add(Fault("error", match=faults.on_device(store, 0), remaining=2))
    read_back(store, keys)
    assert store.probe.devices()[0].state == TRIPPED
    store.step()  # healthy again, but within the cooldown: stays out
    health = store.probe.devices()[0]
    assert health.state == TRIPPED and health.reason.startswith("2 faults in a row")
    later = time.monotonic() + 31
    faults.monitor_clock(store, lambda: later)
    store.step()
    assert store.probe.devices()[0].state == IN_SERVICE


class _SlowTier:
    """A tier of six devices, each in service, whose own check takes `step_s` (a slow device)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.checked = 0
        self.devices = [(DeviceHealth(f"dev{i}", "disk"), None, f"/dev/fake{i}") for i in range(6)]

    def watched(self):
        return self.devices

    def recheck(self, i: int) -> str | None:
        self.checked += 1
        time.sleep(self.step_s)
        return None

    def take_out(self, i: int, state: str, reason: str) -> None:
        raise AssertionError("no device here fails")

    def revalidate(self, i: int, path: str | None) -> bool:
        raise AssertionError("no device here is out")


def test_closing_the_watch_stops_it_within_one_devices_step():
    """A check goes over every device; closing mid-check waits out the device in hand
    (`join_s`), not the rest: after close() the watch touches the tier no more."""
    tier = _SlowTier(step_s=0.3)
    watch = DeviceWatch(tier, interval_s=0.01, cooldown_s=30, join_s=5.0, name="test-watch")
    deadline = time.monotonic() + 10
    while tier.checked == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    before = tier.checked  # the device in hand is this one, or the next if it has just begun
    watch.close()
    checked = tier.checked
    time.sleep(0.7)
    assert tier.checked == checked <= before + 1, f"{tier.checked} devices checked after close " \
        f"({before} when it was called)"
