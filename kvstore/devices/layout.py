"""Per-device layout: two superblock copies, the index checkpoint area, the record slots.

    offset 0              superblock (4096 bytes, below)
    offset 4096           the same superblock again (a damaged first copy is not fatal)
    offset 8192           checkpoint area: CHECKPOINT_DTYPE entries, padded to 4096
    offset data_offset    slot 0, slot 1, ... each `slot_bytes` (a record, see record.py)

Superblock fields (little-endian): magic b"KVSB", version u16 (3), pad u16, slot_bytes
u64, num_slots u64, data_offset u64, chunk_bytes u64, clean u8 + 7 pad,
checkpoint_entries u64, checkpoint_checksum (xxh3-64) u64, device uuid 16 bytes, then
xxh3-64 of all that.

`clean` is set only by a clean shutdown, after the checkpoint is written, and is
cleared on open before the first write. So a checkpoint is trusted only if nothing
can have been written since it was taken; otherwise the slots are scanned. Both
copies are written in turn, so a torn write damages at most one of them. When both
are damaged, the geometry follows from the config and the slots are scanned (every
record verifies itself), so one bad bit never makes a whole tier unusable.

The version names the records' format too, their keys' included (kvstore/format/keys.py:
KEY_FORMAT; version 3 holds key format 2). A tier an older kvstore formatted is started
empty: its records are of keys this version never computes, never read as its own.
"""

from __future__ import annotations

import logging
import os
import struct
import uuid
from dataclasses import dataclass, replace

import numpy as np
import xxhash

from kvstore.devices.device import Device
from kvstore.format.errors import DeviceError
from kvstore.format.record import BLOCK, round_up
from kvstore.format.units import format_size
from kvstore.io.aligned import AlignedBuffer
from kvstore.io.base import TIMED_OUT, IoBuffer, IoEngine, IoRequest

log = logging.getLogger(__name__)
SB_MAGIC = b"KVSB"
SB_VERSION = 3
SB_COPIES = 2
_SB_BODY = struct.Struct("<4sHHQQQQB7xQQ16s")
_SB_SUM = struct.Struct("<Q")
_VERSION = struct.Struct("<H")
CHECKPOINT_DTYPE = np.dtype([("slot", "<u4"), ("seq", "<u8"), ("key", "S16"), ("parent", "S16")])


@dataclass(frozen=True)
class CheckpointMark:
    """What the superblock says of the checkpoint area. Invariant: `clean` only after a
    clean close wrote `entries` entries hashing to `checksum`; cleared (the counts kept)
    before the first write after an open, so a stale checkpoint is never trusted."""

    clean: bool = False
    entries: int = 0
    checksum: int = 0


@dataclass(frozen=True)
class Superblock:
    """A device's geometry, checkpoint mark and identity. Grouping fields changes no byte:
    `pack` and `parse_superblock` keep the flat layout in this module's docstring."""

    slot_bytes: int
    num_slots: int
    data_offset: int
    chunk_bytes: int
    checkpoint: CheckpointMark = CheckpointMark()
    device_id: bytes = b""

    def pack(self) -> bytes:
        mark = self.checkpoint
        body = _SB_BODY.pack(SB_MAGIC, SB_VERSION, 0, self.slot_bytes, self.num_slots,
                             self.data_offset, self.chunk_bytes, int(mark.clean),
                             mark.entries, mark.checksum, self.device_id)
        block = body + _SB_SUM.pack(xxhash.xxh3_64_intdigest(body))
        return block + bytes(BLOCK - len(block))


class _Copy:
    """What one superblock copy holds."""

    EMPTY, FOREIGN, DAMAGED, OLD_FORMAT, VALID = range(5)


def parse_superblock(block: bytes) -> tuple[int, Superblock | None]:
    """(one of _Copy's states, the superblock if VALID); never raises on garbage."""
    head = block[: _SB_BODY.size + _SB_SUM.size]
    if not any(head):
        return _Copy.EMPTY, None
    if head[:4] != SB_MAGIC:
        return _Copy.FOREIGN, None
    (version,) = _VERSION.unpack_from(head, 4)
    if version != SB_VERSION:
        return (_Copy.OLD_FORMAT if version < SB_VERSION else _Copy.DAMAGED), None
    body = head[: _SB_BODY.size]
    (stored,) = _SB_SUM.unpack_from(head, _SB_BODY.size)
    if xxhash.xxh3_64_intdigest(body) != stored:
        return _Copy.DAMAGED, None
    (_, _, _, slot_bytes, num_slots, data_offset, chunk_bytes, clean, entries, checksum,
     device_id) = _SB_BODY.unpack(body)
    return _Copy.VALID, Superblock(slot_bytes, num_slots, data_offset, chunk_bytes,
                                   CheckpointMark(bool(clean), entries, checksum), device_id)


def geometry(capacity: int, slot_bytes: int) -> tuple[int, int]:
    """(num_slots, data_offset) filling at most `capacity` bytes."""
    per_slot = slot_bytes + CHECKPOINT_DTYPE.itemsize
    num_slots = max(0, (capacity - SB_COPIES * BLOCK) // per_slot)
    while num_slots and _data_offset(num_slots) + num_slots * slot_bytes > capacity:
        num_slots -= 1
    return num_slots, _data_offset(num_slots)


def _data_offset(num_slots: int) -> int:
    return SB_COPIES * BLOCK + round_up(num_slots * CHECKPOINT_DTYPE.itemsize)


class DeviceLayout:
    """A device's superblock plus reads and writes of its metadata.

    `fresh`: formatted by this open (no slot has ever been written); `rebuilt`: both
    superblock copies were damaged and the geometry came from the config (its
    checkpoint, if any, is unusable: the slots must be scanned).
    """

    def __init__(self, device: Device, engine: IoEngine, superblock: Superblock,
                 timeout_s: float | None, *, fresh: bool = False, rebuilt: bool = False) -> None:
        self.device = device
        self.engine = engine
        self.sb = superblock
        self.timeout_s = timeout_s  # every metadata I/O has this deadline (None: none)
        self.fresh = fresh
        self.rebuilt = rebuilt

    @classmethod
    def open(cls, device: Device, engine: IoEngine, slot_bytes: int, chunk_bytes: int,
             timeout_s: float | None = None) -> DeviceLayout:
        num_slots, data_offset = geometry(device.size, slot_bytes)
        if num_slots == 0:
            raise DeviceError(device.path, f"capacity {format_size(device.size)} holds no "
                                           f"{format_size(slot_bytes)} record slot")
        wanted = Superblock(slot_bytes, num_slots, data_offset, chunk_bytes,
                            device_id=uuid.uuid4().bytes)
        copies = read_superblocks(engine, device.fd, device.path, timeout_s)
        states = [state for state, _ in copies]
        found = next((sb for state, sb in copies if state == _Copy.VALID), None)
        where = "its first 8 KiB" if device.is_block else "the file"
        if found is None:
            if _Copy.OLD_FORMAT in states and _Copy.FOREIGN not in states:
                log.warning("%s: formatted by an older kvstore, whose records are of another key "
                            "format; formatting it anew (on-disk format %d): it starts empty",
                            device.path, SB_VERSION)
                states = [_Copy.EMPTY] * SB_COPIES
            if states == [_Copy.EMPTY] * SB_COPIES:
                layout = cls(device, engine, wanted, timeout_s, fresh=True)
                layout.write_superblock()
                return layout
            if _Copy.FOREIGN in states and _Copy.DAMAGED not in states:
                raise DeviceError(device.path, "holds data that is not a kvstore tier; refusing to "
                                               f"overwrite it (wipe {where} to hand it to kvstore)")
            log.warning("%s: both superblock copies are damaged; rebuilding them from the config "
                        "and scanning every slot (each record verifies itself)", device.path)
            layout = cls(device, engine, wanted, timeout_s, rebuilt=True)
            layout.write_superblock()
            return layout
        if (found.chunk_bytes, found.slot_bytes, found.num_slots) != (chunk_bytes, slot_bytes, num_slots):
            raise DeviceError(device.path, f"formatted for {found.num_slots} slots of "
                              f"{format_size(found.chunk_bytes)} chunks, but this config needs "
                              f"{num_slots} of {format_size(chunk_bytes)} (chunk size or capacity "
                              f"changed); use another path, or delete {where} to start empty")
        layout = cls(device, engine, found, timeout_s)
        if states != [_Copy.VALID] * SB_COPIES or copies[0][1] != copies[1][1]:
            log.warning("%s: a superblock copy was damaged or stale; rewriting both", device.path)
            layout.write_superblock()
        return layout

    @classmethod
    def view(cls, device: Device, engine: IoEngine, slot_bytes: int,
             timeout_s: float | None) -> DeviceLayout:
        """Another host's layout, read and never written: its valid superblock, which must
        hold slots of `slot_bytes` (DeviceError otherwise)."""
        return cls(device, engine, _foreign_superblock(engine, device, slot_bytes, timeout_s), timeout_s)

    def reread(self) -> None:
        """A view's superblock read again (its owner may have reformatted the device:
        a new device id, so index entries naming the old one no longer match)."""
        self.sb = _foreign_superblock(self.engine, self.device, self.sb.slot_bytes, self.timeout_s)

    def still_ours(self) -> str | None:
        """None when the device still holds this layout's superblock; else what is wrong.
        A namespace that comes back must be the same one, not a reformatted or swapped one."""
        try:
            copies = read_superblocks(self.engine, self.device.fd, self.device.path, self.timeout_s)
        except DeviceError as exc:
            return str(exc)
        ids = {sb.device_id for _, sb in copies if sb is not None}
        if self.sb.device_id not in ids:
            return "superblock changed (another device, or reformatted)"
        return None

    def slot_offset(self, slot: int) -> int:
        return self.sb.data_offset + slot * self.sb.slot_bytes

    def write_superblock(self) -> None:
        """Both copies, one after the other: a torn write damages at most one."""
        block = self.sb.pack()
        for copy in range(SB_COPIES):
            _write(self.engine, self.device, copy * BLOCK, block, self.timeout_s, "superblock write")

    def take_checkpoint(self) -> np.ndarray | None:
        """The clean-shutdown index if it verifies; marks the device dirty either way."""
        entries = None
        mark = self.sb.checkpoint
        if mark.clean and not self.rebuilt:
            size = mark.entries * CHECKPOINT_DTYPE.itemsize
            try:
                raw = _read(self.engine, self.device.fd, self.device.path, SB_COPIES * BLOCK,
                            round_up(max(size, 1)), self.timeout_s, "checkpoint read")[:size]
            except DeviceError as exc:
                log.warning("%s; scanning the slots instead", exc)
            else:
                if xxhash.xxh3_64_intdigest(raw) == mark.checksum:
                    entries = np.frombuffer(raw, dtype=CHECKPOINT_DTYPE)
                else:
                    log.warning("%s: checkpoint does not verify; scanning the slots instead",
                                self.device.path)
        self.mark_dirty()
        return entries

    def mark_dirty(self) -> None:
        """Before the first write: a checkpoint on the device no longer describes it."""
        self.sb = replace(self.sb, checkpoint=replace(self.sb.checkpoint, clean=False))
        self.write_superblock()

    def write_checkpoint(self, entries: np.ndarray) -> None:
        raw = entries.astype(CHECKPOINT_DTYPE).tobytes()
        _write(self.engine, self.device, SB_COPIES * BLOCK, raw, self.timeout_s, "checkpoint write")
        self.sb = replace(self.sb, checkpoint=CheckpointMark(True, len(entries),
                                                             xxhash.xxh3_64_intdigest(raw)))
        self.rebuilt = False
        self.write_superblock()


def read_superblocks(engine: IoEngine, fd: int, path: str,
                     timeout_s: float | None) -> list[tuple[int, Superblock | None]]:
    """Both copies of a device's superblock, parsed (`parse_superblock`), in one read within
    `timeout_s`; DeviceError if it fails or misses the deadline. The one online reader of
    superblocks: a device this host opens, revalidates, or reads as a peer's."""
    raw = _read(engine, fd, path, 0, SB_COPIES * BLOCK, timeout_s, "superblock read")
    return [parse_superblock(raw[i * BLOCK : (i + 1) * BLOCK]) for i in range(SB_COPIES)]


def _foreign_superblock(engine: IoEngine, device: Device, slot_bytes: int,
                        timeout_s: float | None) -> Superblock:
    copies = read_superblocks(engine, device.fd, device.path, timeout_s)
    sb = next((c for _, c in copies if c is not None), None)
    if sb is None:
        raise DeviceError(device.path, "no kvstore superblock (not formatted yet, or damaged)")
    if sb.slot_bytes != slot_bytes:
        raise DeviceError(device.path, f"formatted for {format_size(sb.chunk_bytes)} chunks; this "
                                       f"store's slots are {format_size(slot_bytes)}")
    return sb


def _metadata(nbytes: int) -> IoBuffer:
    """An aligned buffer for one metadata I/O, unmapped once its maker and the I/O let go (a
    read or write that missed its deadline may still move its bytes: io/base.py)."""
    buffer = AlignedBuffer(nbytes)
    return IoBuffer([buffer.view[:nbytes]], lambda _: buffer.close())


def _read(engine: IoEngine, fd: int, path: str, offset: int, nbytes: int, timeout_s: float | None,
          what: str) -> bytes:
    memory = _metadata(nbytes)
    try:
        _check(engine.run([IoRequest(fd, offset, [memory])], timeout_s)[0], nbytes, path, what)
        return bytes(memory.views[0])
    finally:
        memory.close()


def _write(engine: IoEngine, device: Device, offset: int, data: bytes, timeout_s: float | None,
           what: str) -> None:
    nbytes = round_up(max(len(data), 1))
    memory = _metadata(nbytes)
    try:
        memory.views[0][: len(data)] = data
        result = engine.run([IoRequest(device.fd, offset, [memory], write=True)], timeout_s)[0]
        _check(result, nbytes, device.path, what)
    finally:
        memory.close()


def _check(result: int, expected: int, path: str, what: str) -> None:
    if result == TIMED_OUT:
        raise DeviceError(path, f"{what} did not finish within its deadline")
    if result < 0:
        raise DeviceError(path, f"{what} failed: {os.strerror(-result)}")
    if result != expected:
        raise DeviceError(path, f"{what} moved {result} of {expected} bytes")
