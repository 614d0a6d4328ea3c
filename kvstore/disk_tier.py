"""The disk tier: record slots on one or more devices, striped, O_DIRECT.

Write order makes a valid header imply a complete payload: for a slot that held a
record before, its old header is zeroed first; then the payload is written; the
header goes last. A crash at any point leaves either an empty slot, the old
record intact, or a header-less new payload: never a valid header over wrong
bytes. Reads still verify the payload checksum (bit rot, foreign writers).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.aligned import AlignedBuffer
from kvstore.config import DiskPathConfig
from kvstore.devices import DATA_FILE, Device, open_device
from kvstore.disk_layout import CHECKPOINT_DTYPE, DeviceLayout
from kvstore.io.base import IoEngine, IoRequest
from kvstore.record import HEADER_BLOCK, HeaderState, invalidate_header, parse_header, round_up
from kvstore.slots import SlotTable

log = logging.getLogger(__name__)
SCAN_BATCH = 1024  # header blocks read per scan request batch


@dataclass
class RecoveryReport:
    records: int = 0
    torn: int = 0
    from_checkpoint: int = 0  # devices whose index came from a clean-shutdown checkpoint
    scanned: int = 0  # devices whose slots were scanned
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

    def __init__(self, paths: Sequence[DiskPathConfig], slot_bytes: int, engine: IoEngine,
                 file_name: str = DATA_FILE) -> None:
        self.slot_bytes = slot_bytes
        self.engine = engine
        self.devices: list[Device] = []
        try:
            for entry in paths:
                self.devices.append(open_device(entry.path, entry.capacity, file_name))
            self.layouts = [DeviceLayout.open(d, engine, slot_bytes) for d in self.devices]
        except BaseException:
            self._close_devices()
            raise
        self.table = SlotTable([layout.sb.num_slots for layout in self.layouts])
        self._zero_header = AlignedBuffer(HEADER_BLOCK)
        invalidate_header(self._zero_header.view)

    def locate(self, slot: int) -> tuple[int, int]:
        """(fd, byte offset) of a slot."""
        group, local = self.table.group_of(slot)
        layout = self.layouts[group]
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
        return self.engine.run(requests, timeout_s, on_complete)

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
            base = self.table.group_start[group]
            entries = layout.take_checkpoint()
            if entries is not None:
                report.from_checkpoint += 1
                records = [(int(e["seq"]), base + int(e["slot"]), bytes(e["key"]).ljust(16, b"\0"),
                            bytes(e["parent"]).ljust(16, b"\0")) for e in entries]
            else:
                report.scanned += 1
                records = self._scan(group, layout, report, timeout_s)
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
                        report.torn += 1
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
        """Clean shutdown: write each device's index so the next open skips the scan."""
        per_group: list[list[tuple[int, int, bytes, bytes]]] = [[] for _ in self.layouts]
        for key, slot in self.table.index.items():
            group, local = self.table.group_of(slot)
            info = self.table.slots[slot]
            per_group[group].append((local, info.seq, key, info.parent or bytes(16)))
        for layout, rows in zip(self.layouts, per_group, strict=True):
            layout.write_checkpoint(np.array(rows, dtype=CHECKPOINT_DTYPE))

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
