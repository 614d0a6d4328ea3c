"""Rebuild the disk tier's index at start, and write the checkpoint that speeds it up.

At start each device's index comes from its clean-shutdown checkpoint when that is
trustworthy (layout.take_checkpoint), else from a scan of every slot's header. A key
found in two slots (a crash between writing a newer copy and dropping the old one)
keeps the newest sequence number; the older copy's header is zeroed so it can never
come back. Every slot of a device that existed before this start may still hold an
old header, so the first write to any of them zeroes it first (disk_tier.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np

from kvstore.devices.device_set import DeviceSet
from kvstore.devices.health import DeviceHealth
from kvstore.devices.layout import CHECKPOINT_DTYPE
from kvstore.devices.scanner import scan_headers
from kvstore.format.errors import DeviceError
from kvstore.format.record import HeaderState
from kvstore.io.base import IoEngine
from kvstore.tiers.slots import DiskSlotTable, Entry
from kvstore.tiers.stats import Stats

log = logging.getLogger(__name__)



class DiskParts(Protocol):
    """What recovery, the checkpoint and a device's revalidation (availability.py) use of
    the disk tier (disk.py's DiskTier, which holds them), named here so that neither
    module imports the tier that uses them."""

    devices: DeviceSet
    table: DiskSlotTable
    engine: IoEngine
    stats: Stats
    timeout_s: float

    def zero_headers(self, slots: Sequence[int], timeout_s: float) -> list[bool]: ...

@dataclass
class RecoveryReport:
    """Counted as recovery goes: it starts empty (its constructor takes nothing)."""

    records: int = field(default=0, init=False)
    torn: int = field(default=0, init=False)
    stale: int = field(default=0, init=False)  # older copies of a key, zeroed
    from_checkpoint: int = field(default=0, init=False)  # devices indexed from a clean-shutdown checkpoint
    scanned: int = field(default=0, init=False)  # devices whose slots were scanned
    io_errors: int = field(default=0, init=False)  # header reads that failed (slots treated as torn)
    seconds: float = field(default=0.0, init=False)
    max_seq: int = field(default=0, init=False)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def scan_group(disk: DiskParts, group: int, report: RecoveryReport,
               deleted: Callable[[bytes, bytes], bool] | None = None) -> tuple[list[Entry], list[Entry]]:
    """The valid records of one device, by scanning every slot's header: (those to
    serve, those `deleted(key, namespace)` names, to be zeroed)."""
    layout = disk.devices.layouts[group]
    assert layout is not None
    base = disk.table.groups.start[group]
    found: list[Entry] = []
    gone: list[Entry] = []
    for scanned in scan_headers(disk.engine, layout.device.fd, layout.sb.data_offset,
                                layout.sb.slot_bytes, layout.sb.num_slots, disk.timeout_s):
        if scanned.state is None:
            report.io_errors += 1
        elif scanned.state is HeaderState.TORN:
            report.torn += 1
        elif scanned.header is not None:
            header = scanned.header
            entry = Entry(header.key, base + scanned.slot, _parent(header.parent), header.seq)
            (gone if deleted is not None and deleted(header.key, header.namespace) else found).append(entry)
    return found, gone


def newest(entries: Iterable[Entry]) -> tuple[list[Entry], list[Entry]]:
    """(one entry per key: the highest sequence number, the older copies)."""
    best: dict[bytes, Entry] = {}
    stale = []
    for entry in entries:
        current = best.get(entry.key)
        if current is None or current.seq < entry.seq:
            if current is not None:
                stale.append(current)
            best[entry.key] = entry
        else:
            stale.append(entry)
    return sorted(best.values(), key=lambda e: e.seq), stale


def recover(disk: DiskParts) -> RecoveryReport:
    """Rebuild the index of every opened device (checkpoint, else scan)."""
    report = RecoveryReport()
    start = time.perf_counter()
    entries: list[Entry] = []
    existed = []
    for group, layout in enumerate(disk.devices.layouts):
        if layout is None:
            continue
        if not layout.fresh:
            existed.append(group)
        base = disk.table.groups.start[group]
        checkpoint = layout.take_checkpoint()
        if checkpoint is not None:
            report.from_checkpoint += 1
            entries += [Entry(bytes(e["key"]).ljust(16, b"\0"), base + int(e["slot"]),
                              _parent(bytes(e["parent"]).ljust(16, b"\0")), int(e["seq"]))
                        for e in checkpoint]
        else:
            report.scanned += 1
            entries += scan_group(disk, group, report)[0]
    report.torn += report.io_errors
    winners, stale = newest(entries)
    if stale:
        zeroed = disk.zero_headers([e.slot for e in stale], disk.timeout_s)
        log.warning("disk tier: %d older copies of keys found; %d headers zeroed", len(stale),
                    sum(zeroed))
    disk.table.restore(winners, existed)
    report.records = len(winners)
    report.stale = len(stale)
    report.max_seq = max((e.seq for e in entries), default=0)
    report.seconds = time.perf_counter() - start
    return report


def _parent(parent: bytes) -> bytes | None:
    return None if parent == bytes(16) else parent


def checkpoint(disk: DiskParts, health: Sequence[DeviceHealth]) -> None:
    """Clean shutdown: write each device's index so the next open skips the scan.

    A device out of service gets none (its index here is empty, not its disk): the
    next open scans it. A failed checkpoint write costs the same, a scan.
    """
    table = disk.table
    per_group: list[list[tuple[int, int, bytes, bytes]]] = [[] for _ in disk.devices.layouts]
    for entry in table.entries():
        group, local = table.groups.of(entry.slot)
        per_group[group].append((local, entry.seq, entry.key, entry.parent or bytes(16)))
    for layout, rows, device in zip(disk.devices.layouts, per_group, health, strict=True):
        if not device.in_service or layout is None:
            continue
        try:
            layout.write_checkpoint(np.array(rows, dtype=CHECKPOINT_DTYPE))
        except DeviceError as exc:
            log.warning("disk tier: no checkpoint for %s (%s); the next start scans it",
                        device.label, exc)
