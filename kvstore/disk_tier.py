"""The disk tier: record slots on one or more devices, striped, O_DIRECT.

Write order makes a valid header imply a complete payload: for a slot that held a
record before, its old header is zeroed first; then the payload is written; the
header goes last. A crash at any point leaves either an empty slot, the old
record intact, or a header-less new payload: never a valid header over wrong
bytes. Reads still verify the payload checksum (bit rot, foreign writers).

Each device has a DeviceHealth. A device that faults repeatedly, or whose probe
fails, is taken out of service: its chunks leave the index at once (misses, not
deadlines), nothing new is placed there, and writes in flight to it are never
published. It serves again only after revalidation: the same superblock, the
headers of those in-flight writes zeroed, and every slot's header re-read.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.aligned import AlignedBuffer
from kvstore.device_health import OFFLINE, TRIPPED, DeviceHealth, is_fault
from kvstore.devices import DATA_FILE, Device, DevicePlan, open_device
from kvstore.disk_layout import CHECKPOINT_DTYPE, DeviceLayout, geometry
from kvstore.errors import DeviceError
from kvstore.io.base import TIMED_OUT, IoEngine, IoRequest
from kvstore.record import HEADER_BLOCK, HeaderState, invalidate_header, parse_header, round_up
from kvstore.slots import SlotTable
from kvstore.stats import Stats

log = logging.getLogger(__name__)
SCAN_BATCH = 1024  # header blocks read per scan request batch


@dataclass
class RecoveryReport:
    records: int = 0
    torn: int = 0
    from_checkpoint: int = 0  # devices whose index came from a clean-shutdown checkpoint
    scanned: int = 0  # devices whose slots were scanned
    io_errors: int = 0  # header reads that failed (their slots are treated as torn)
    seconds: float = 0.0
    max_seq: int = 0


@dataclass(slots=True)
class DiskWrite:
    """One record to write: `image` is header block + payload, aligned."""

    slot: int
    image: memoryview
    payload_len: int


class DiskTier:
    name = "disk"

    def __init__(self, plans: Sequence[DevicePlan], slot_bytes: int, engine: IoEngine, *,
                 lock: threading.Lock, stats: Stats, timeout_s: float, breaker_threshold: int = 3,
                 file_name: str = DATA_FILE) -> None:
        self.slot_bytes = slot_bytes
        self.engine = engine
        self.lock = lock  # the owning store's lock: it guards `table` and `health`
        self.stats = stats
        self.timeout_s = timeout_s
        self.breaker_threshold = breaker_threshold
        self.plans = list(plans)
        self.file_name = file_name
        self.devices: list[Device] = []
        self.layouts: list[DeviceLayout | None] = []  # None: not opened yet (absent at start)
        try:
            for plan in plans:
                if plan.path is None:
                    self.devices.append(Device(plan.label, -1, plan.capacity, True, 4096))
                    self.layouts.append(None)
                    continue
                self.devices.append(open_device(plan.path, plan.capacity, file_name))
                self.layouts.append(DeviceLayout.open(self.devices[-1], engine, slot_bytes, timeout_s))
        except BaseException:
            self._close_devices()
            raise
        self.table = SlotTable([geometry(plan.capacity, slot_bytes)[0] if layout is None
                                else layout.sb.num_slots for plan, layout in zip(plans, self.layouts,
                                                                               strict=True)])
        self.health = [DeviceHealth(plan.label or plan.path or "", plan.kind) for plan in plans]
        # Per device: slots reserved for a write when it left service (zeroed on revalidation).
        self._in_flight_at_loss: list[set[int]] = [set() for _ in plans]
        self._zero_header = AlignedBuffer(HEADER_BLOCK)
        invalidate_header(self._zero_header.view)
        for group, layout in enumerate(self.layouts):
            if layout is None:  # served once it appears (health_monitor.py)
                self.take_out(group, OFFLINE, "not present at start-up")

    def kind_of(self, slot: int) -> str:
        return self.health[self.table.group_of(slot)[0]].kind

    def epoch_of(self, slot: int) -> int:
        """The epoch of the slot's device (store lock held); see `still_serving`."""
        return self.health[self.table.group_of(slot)[0]].epoch

    def still_serving(self, slot: int, epoch: int) -> bool:
        """Whether the slot's device has stayed in service since `epoch` (store lock held)."""
        health = self.health[self.table.group_of(slot)[0]]
        return health.in_service and health.epoch == epoch

    def locate(self, slot: int) -> tuple[int, int]:
        """(fd, byte offset) of a slot (of an opened device: others have no slots in use)."""
        group, local = self.table.group_of(slot)
        layout = self.layouts[group]
        assert layout is not None
        return layout.device.fd, layout.slot_offset(local)

    def describe(self, slot: int) -> str:
        """Where a slot lives, for log lines an operator can act on."""
        group, local = self.table.group_of(slot)
        return f"slot {local} of {self.devices[group].path}"

    def read_slots(self, slots: Sequence[int], dests: Sequence[memoryview], timeout_s: float,
                   on_complete: Callable[[int, int], None]) -> list[int]:
        """Read whole slots into aligned `dests`; results as the engine gives them."""
        requests = [IoRequest(*self.locate(slot), [dest]) for slot, dest in zip(slots, dests,
                                                                               strict=True)]
        results = self.engine.run(requests, timeout_s, on_complete)
        self._account(slots, results, [len(d) for d in dests])
        return results

    def _open_where_it_is(self, group: int, path: str | None) -> tuple[str | None, bool]:
        """Open a device at `path` (where its probe found it; None: where it was) if it is
        not open there yet: one absent until now, or moved. (problem or None, reopened?)"""
        device, plan = self.devices[group], self.plans[group]
        if path is None or (path == device.path and device.fd >= 0):
            return (None, False) if device.fd >= 0 else ("not present", False)
        device.close()  # first: the old node may be the same device (it holds the flock)
        try:
            opened = open_device(path, plan.capacity, self.file_name)
        except DeviceError as exc:
            return str(exc), False
        try:
            layout = DeviceLayout.open(opened, self.engine, self.slot_bytes, self.timeout_s)
            if layout.sb.num_slots != self.table.group_sizes[group]:
                raise DeviceError(path, f"holds {layout.sb.num_slots} slots, this tier expects "
                                        f"{self.table.group_sizes[group]}")
            layout.mark_dirty()  # it is about to be written: its checkpoint would go stale
        except DeviceError as exc:
            opened.close()
            return str(exc), False
        self.devices[group], self.layouts[group] = opened, layout
        log.warning("disk tier: %s opened at %s", self.health[group].label, path)
        return None, True

    def _account(self, slots: Sequence[int], results: Sequence[int], expected: Sequence[int]) -> None:
        """Feed results to each device's breaker; trip the ones that keep faulting."""
        with self.lock:
            for slot, result, size in zip(slots, results, expected, strict=True):
                group = self.table.group_of(slot)[0]
                health = self.health[group]
                if health.record(is_fault(result, size), self.breaker_threshold):
                    why = "deadline passed" if result == TIMED_OUT else (
                        os.strerror(-result) if result < 0 else f"short transfer ({result} bytes)")
                    self.take_out(group, TRIPPED, f"{health.consecutive_faults} faults in a row "
                                                  f"(last: {why})")

    def take_out(self, group: int, state: str, reason: str) -> None:
        """Stop serving a device (store lock held): its chunks leave the index now."""
        health = self.health[group]
        health.take_out(state, reason)
        self.table.disabled.add(group)
        lost = 0
        for slot in self.table.group_slots(group):
            info = self.table.slots[slot]
            if info.published and info.key is not None:
                self.table.unpublish(info.key)
                lost += 1
            elif info.pins:
                self._in_flight_at_loss[group].add(slot)
        self.stats.add("disk.lost_chunks", lost)
        if state == TRIPPED:
            self.stats.add("disk.trips")
        log.warning("disk tier: %s taken out of service (%s): %s; %d chunks become misses",
                    health.label, state, reason, lost)

    def revalidate(self, group: int, path: str | None = None) -> bool:
        """Bring a device back (no lock held), opening it at `path` if it is not open
        there: True when it serves again.

        Waits for nothing: if an I/O from before the loss still holds a slot, or any
        check fails, the device stays out and the caller tries again later.
        """
        health = self.health[group]
        with self.lock:
            if health.in_service or any(self.table.slots[s].pins for s in self.table.group_slots(group)):
                return health.in_service
            self.table.free[group] = []
            suspects = sorted(self._in_flight_at_loss[group])
        problem, reopened = self._open_where_it_is(group, path)
        layout = self.layouts[group]
        if problem is None and layout is not None and not reopened:
            problem = layout.still_ours()
        if problem is None and suspects:
            zeroed = self.engine.run([IoRequest(*self.locate(s), [self._zero_header.view[:HEADER_BLOCK]],
                                                write=True) for s in suspects], self.timeout_s)
            if any(r != HEADER_BLOCK for r in zeroed):
                problem = "could not zero the headers of writes in flight at the loss"
        report = RecoveryReport()
        records = self._scan(group, layout, report, self.timeout_s) if problem is None and layout else []
        if problem is None and report.io_errors:
            problem = f"{report.io_errors} header reads failed"
        with self.lock:
            if problem is not None:
                health.reason, health.since = f"revalidation failed: {problem}", time.monotonic()
                log.warning("disk tier: %s stays out of service: %s", health.label, problem)
                return False
            for seq, slot, key, parent in sorted(records):
                if key not in self.table.index:
                    self.table.publish(slot, key, parent, seq)
            self.table.free[group] = [s for s in reversed(self.table.group_slots(group))
                                      if not self.table.slots[s].published]
            self.table.disabled.discard(group)
            self._in_flight_at_loss[group].clear()
            health.put_back()
        self.stats.add("disk.revalidated_chunks", len(records))
        log.warning("disk tier: %s back in service; %d records verified", health.label, len(records))
        return True

    def write_records(self, writes: Sequence[DiskWrite], timeout_s: float) -> list[bool]:
        """Write records into reserved slots in the crash-safe order; True per success."""
        ok = [True] * len(writes)
        phases: list[list[tuple[int, IoRequest]]] = [[], [], []]
        for i, write in enumerate(writes):
            fd, offset = self.locate(write.slot)
            info = self.table.slots[write.slot]
            if info.ever_written:
                phases[0].append((i, IoRequest(fd, offset, [self._zero_header.view[:HEADER_BLOCK]],
                                               write=True)))
            info.ever_written = True
            payload = write.image[HEADER_BLOCK : HEADER_BLOCK + round_up(write.payload_len)]
            phases[1].append((i, IoRequest(fd, offset + HEADER_BLOCK, [payload], write=True)))
            phases[2].append((i, IoRequest(fd, offset, [write.image[:HEADER_BLOCK]], write=True)))
        for phase in phases:
            pending = [(i, req) for i, req in phase if ok[i]]
            results = self.engine.run([req for _, req in pending], timeout_s)
            self._account([writes[i].slot for i, _ in pending], results, [r.nbytes for _, r in pending])
            for (i, req), result in zip(pending, results, strict=True):
                if result != req.nbytes:
                    ok[i] = False
        return ok

    def invalidate(self, slot: int, timeout_s: float) -> bool:
        """Zero a slot's header so a restart does not bring its record back."""
        fd, offset = self.locate(slot)
        request = IoRequest(fd, offset, [self._zero_header.view[:HEADER_BLOCK]], write=True)
        return self.engine.run([request], timeout_s)[0] == HEADER_BLOCK

    def recover(self, timeout_s: float) -> RecoveryReport:
        """Rebuild the index: from each device's checkpoint, else by scanning headers."""
        report = RecoveryReport()
        start = time.perf_counter()
        found: dict[bytes, tuple[int, int, bytes]] = {}  # key -> (seq, slot, parent)
        for group, layout in enumerate(self.layouts):
            if layout is None:
                continue
            base = self.table.group_start[group]
            entries = layout.take_checkpoint()
            if entries is not None:
                report.from_checkpoint += 1
                records = [(int(e["seq"]), base + int(e["slot"]), bytes(e["key"]).ljust(16, b"\0"),
                            bytes(e["parent"]).ljust(16, b"\0")) for e in entries]
            else:
                report.scanned += 1
                records = self._scan(group, layout, report, timeout_s)
                report.torn += report.io_errors
            for seq, slot, key, parent in records:
                self.table.slots[slot].ever_written = True
                if key not in found or found[key][0] < seq:
                    found[key] = (seq, slot, parent)
        in_use = set()
        for key, (seq, slot, parent) in sorted(found.items(), key=lambda item: item[1][0]):
            in_use.add(slot)
            self.table.publish(slot, key, parent, seq)
            report.max_seq = max(report.max_seq, seq)
        for group, free in enumerate(self.table.free):
            self.table.free[group] = [s for s in free if s not in in_use]
        report.records = len(found)
        report.seconds = time.perf_counter() - start
        return report

    def _scan(self, group: int, layout: DeviceLayout, report: RecoveryReport,
              timeout_s: float) -> list[tuple[int, int, bytes, bytes]]:
        base = self.table.group_start[group]
        buffer = AlignedBuffer(SCAN_BATCH * HEADER_BLOCK)
        records = []
        try:
            for first in range(0, layout.sb.num_slots, SCAN_BATCH):
                count = min(SCAN_BATCH, layout.sb.num_slots - first)
                views = [buffer.view[i * HEADER_BLOCK : (i + 1) * HEADER_BLOCK] for i in range(count)]
                requests = [IoRequest(layout.device.fd, layout.slot_offset(first + i), [views[i]])
                            for i in range(count)]
                results = self.engine.run(requests, timeout_s)
                for i, result in enumerate(results):
                    if result != HEADER_BLOCK:
                        report.io_errors += 1
                        continue
                    state, header = parse_header(views[i])
                    if state is HeaderState.TORN:
                        report.torn += 1
                        self.table.slots[base + first + i].ever_written = True
                    elif header is not None:
                        records.append((header.seq, base + first + i, header.key, header.parent))
        finally:
            views = []
            buffer.close()
        return records

    def checkpoint(self) -> None:
        """Clean shutdown: write each device's index so the next open skips the scan.

        A device out of service gets none (its index here is empty, not its disk):
        the next open scans it. A failed checkpoint write costs the same, a scan.
        """
        per_group: list[list[tuple[int, int, bytes, bytes]]] = [[] for _ in self.layouts]
        for key, slot in self.table.index.items():
            group, local = self.table.group_of(slot)
            info = self.table.slots[slot]
            per_group[group].append((local, info.seq, key, info.parent or bytes(16)))
        for layout, rows, health in zip(self.layouts, per_group, self.health, strict=True):
            if not health.in_service or layout is None:
                continue
            try:
                layout.write_checkpoint(np.array(rows, dtype=CHECKPOINT_DTYPE))
            except DeviceError as exc:
                log.warning("disk tier: no checkpoint for %s (%s); the next start scans it",
                            health.label, exc)

    def used_bytes(self) -> int:
        return len(self.table.index) * self.slot_bytes

    def capacity_bytes(self) -> int:
        return self.table.capacity * self.slot_bytes

    def close(self) -> None:
        self._zero_header.close()
        self._close_devices()

    def _close_devices(self) -> None:
        for device in self.devices:
            device.close()
