"""Per-device layout: superblock, index checkpoint area, then the record slots.

    offset 0              superblock (4096 bytes, below)
    offset 4096           checkpoint area: CHECKPOINT_DTYPE entries, padded to 4096
    offset data_offset    slot 0, slot 1, ... each `slot_bytes` (a record, see record.py)

Superblock fields (little-endian): magic b"KVSB", version u16, pad u16, slot_bytes
u64, num_slots u64, data_offset u64, clean u8 + 7 pad, checkpoint_entries u64,
checkpoint_checksum (xxh3-64) u64, device uuid 16 bytes, then xxh3-64 of all that.

`clean` is set only by a clean shutdown, after the checkpoint is written, and is
cleared on open before the first write. So a checkpoint is trusted only if nothing
can have been written since it was taken; otherwise the slots are scanned.
"""

from __future__ import annotations

import os
import struct
import uuid
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstore.aligned import AlignedBuffer
from kvstore.devices import Device
from kvstore.errors import DeviceError
from kvstore.io.base import TIMED_OUT, IoEngine, IoRequest
from kvstore.record import BLOCK, round_up
from kvstore.units import format_size

SB_MAGIC = b"KVSB"
SB_VERSION = 1
_SB_BODY = struct.Struct("<4sHHQQQB7xQQ16s")
_SB_SUM = struct.Struct("<Q")
CHECKPOINT_DTYPE = np.dtype([("slot", "<u4"), ("seq", "<u8"), ("key", "S16"), ("parent", "S16")])


@dataclass
class Superblock:
    slot_bytes: int
    num_slots: int
    data_offset: int
    clean: bool = False
    checkpoint_entries: int = 0
    checkpoint_checksum: int = 0
    device_id: bytes = b""

    def pack(self) -> bytes:
        body = _SB_BODY.pack(SB_MAGIC, SB_VERSION, 0, self.slot_bytes, self.num_slots,
                             self.data_offset, int(self.clean), self.checkpoint_entries,
                             self.checkpoint_checksum, self.device_id)
        block = body + _SB_SUM.pack(xxhash.xxh3_64_intdigest(body))
        return block + bytes(BLOCK - len(block))

    @classmethod
    def unpack(cls, block: bytes, path: str) -> Superblock | None:
        """None for a never-formatted (all-zero) start; DeviceError for foreign data."""
        if not any(block[: _SB_BODY.size + _SB_SUM.size]):
            return None
        fields = _SB_BODY.unpack(block[: _SB_BODY.size])
        (stored,) = _SB_SUM.unpack(block[_SB_BODY.size : _SB_BODY.size + _SB_SUM.size])
        if fields[0] != SB_MAGIC:
            raise DeviceError(path, "holds data that is not a kvstore tier; refusing to overwrite "
                                    "it (wipe its first 4 KiB to hand it to kvstore)")
        if xxhash.xxh3_64_intdigest(block[: _SB_BODY.size]) != stored or fields[1] != SB_VERSION:
            raise DeviceError(path, "kvstore superblock is damaged or from another format version")
        _, _, _, slot_bytes, num_slots, data_offset, clean, entries, checksum, device_id = fields
        return cls(slot_bytes, num_slots, data_offset, bool(clean), entries, checksum, device_id)


def geometry(capacity: int, slot_bytes: int) -> tuple[int, int]:
    """(num_slots, data_offset) filling at most `capacity` bytes."""
    per_slot = slot_bytes + CHECKPOINT_DTYPE.itemsize
    num_slots = max(0, (capacity - BLOCK) // per_slot)
    while num_slots and _data_offset(num_slots) + num_slots * slot_bytes > capacity:
        num_slots -= 1
    return num_slots, _data_offset(num_slots)


def _data_offset(num_slots: int) -> int:
    return BLOCK + round_up(num_slots * CHECKPOINT_DTYPE.itemsize)


class DeviceLayout:
    """A device's superblock plus reads and writes of its metadata."""

    def __init__(self, device: Device, engine: IoEngine, superblock: Superblock,
                 timeout_s: float | None) -> None:
        self.device = device
        self.engine = engine
        self.sb = superblock
        self.timeout_s = timeout_s  # every metadata I/O has this deadline (None: none)

    @classmethod
    def open(cls, device: Device, engine: IoEngine, slot_bytes: int,
             timeout_s: float | None = None) -> DeviceLayout:
        num_slots, data_offset = geometry(device.size, slot_bytes)
        if num_slots == 0:
            raise DeviceError(device.path, f"capacity {format_size(device.size)} holds no "
                                           f"{format_size(slot_bytes)} record slot")
        found = Superblock.unpack(_read_block(engine, device, timeout_s), device.path)
        if found is None:
            layout = cls(device, engine, Superblock(slot_bytes, num_slots, data_offset,
                                                    device_id=uuid.uuid4().bytes), timeout_s)
            layout.write_superblock()
            return layout
        if (found.slot_bytes, found.num_slots) != (slot_bytes, num_slots):
            where = "its first 4 KiB" if device.is_block else "the file"
            raise DeviceError(device.path, f"formatted for {found.num_slots} slots of "
                              f"{format_size(found.slot_bytes)}, but this config needs {num_slots}"
                              f" of {format_size(slot_bytes)} (chunk size or capacity changed); "
                              f"use another path, or delete {where} to start empty")
        return cls(device, engine, found, timeout_s)

    def still_ours(self) -> str | None:
        """None when the device still holds this layout's superblock; else what is wrong.
        A namespace that comes back must be the same one, not a reformatted or swapped one."""
        try:
            found = Superblock.unpack(_read_block(self.engine, self.device, self.timeout_s),
                                      self.device.path)
        except DeviceError as exc:
            return str(exc)
        if found is None or found.device_id != self.sb.device_id:
            return "superblock changed (another device, or reformatted)"
        return None

    def slot_offset(self, slot: int) -> int:
        return self.sb.data_offset + slot * self.sb.slot_bytes

    def write_superblock(self) -> None:
        buffer = AlignedBuffer(BLOCK)
        buffer.view[:BLOCK] = self.sb.pack()
        _check(self.engine.run([IoRequest(self.device.fd, 0, [buffer.view[:BLOCK]], write=True)],
                               self.timeout_s), self.device.path, "superblock write")
        buffer.close()

    def take_checkpoint(self) -> np.ndarray | None:
        """The clean-shutdown index if it verifies; marks the device dirty either way."""
        entries = None
        if self.sb.clean:
            nbytes = round_up(max(self.sb.checkpoint_entries * CHECKPOINT_DTYPE.itemsize, 1))
            buffer = AlignedBuffer(nbytes)
            results = self.engine.run([IoRequest(self.device.fd, BLOCK, [buffer.view[:nbytes]])],
                                      self.timeout_s)
            raw = bytes(buffer.view[: self.sb.checkpoint_entries * CHECKPOINT_DTYPE.itemsize])
            buffer.close()
            if results[0] == nbytes and xxhash.xxh3_64_intdigest(raw) == self.sb.checkpoint_checksum:
                entries = np.frombuffer(raw, dtype=CHECKPOINT_DTYPE)
        self.mark_dirty()
        return entries

    def mark_dirty(self) -> None:
        """Before the first write: a checkpoint on the device no longer describes it."""
        self.sb.clean = False
        self.write_superblock()

    def write_checkpoint(self, entries: np.ndarray) -> None:
        raw = entries.astype(CHECKPOINT_DTYPE).tobytes()
        nbytes = round_up(max(len(raw), 1))
        buffer = AlignedBuffer(nbytes)
        buffer.view[: len(raw)] = raw
        _check(self.engine.run([IoRequest(self.device.fd, BLOCK, [buffer.view[:nbytes]], write=True)],
                               self.timeout_s), self.device.path, "checkpoint write")
        buffer.close()
        self.sb.clean = True
        self.sb.checkpoint_entries = len(entries)
        self.sb.checkpoint_checksum = xxhash.xxh3_64_intdigest(raw)
        self.write_superblock()


def _read_block(engine: IoEngine, device: Device, timeout_s: float | None) -> bytes:
    buffer = AlignedBuffer(BLOCK)
    _check(engine.run([IoRequest(device.fd, 0, [buffer.view[:BLOCK]])], timeout_s), device.path,
           "superblock read")
    data = bytes(buffer.view[:BLOCK])
    buffer.close()
    return data


def _check(results: list[int], path: str, what: str) -> None:
    if results[0] == TIMED_OUT:
        raise DeviceError(path, f"{what} did not finish within its deadline")
    if results[0] < 0:
        raise DeviceError(path, f"{what} failed: {os.strerror(-results[0])}")
