"""The DRAM tier: one aligned slab carved into record-sized slots.

A slot holds the exact record image that goes to disk (header block + payload),
so demotion is one write straight from the slab and promotion one read into it,
with no re-encoding. The slab is private anonymous memory (transparent huge pages
asked for, so a disk read into a slot stays one request). It is not registered with
CUDA: engines copy to the device from their own windows, never from the slab. Its
pages are faulted in by a background thread at start (MADV_POPULATE_WRITE, which
leaves contents alone): otherwise the first reads into each slot pay the faults
inside io_uring submission, several times the CPU of the read itself.
"""

from __future__ import annotations

import ctypes
import threading

from kvstore.format.errors import ConfigError
from kvstore.format.record import (
    HEADER_BLOCK,
    KEY_OFFSET,
    RecordHeader,
    pack_header,
    read_payload_len,
)
from kvstore.format.units import format_size
from kvstore.io.aligned import AlignedBuffer
from kvstore.io.copier import copy_bytes
from kvstore.tiers.slots import SlotTable


class DramTier:
    name = "host"

    def __init__(self, capacity: int, slot_bytes: int) -> None:
        num_slots = capacity // slot_bytes
        if num_slots == 0:
            raise ConfigError("tiers.host.capacity", format_size(capacity),
                              f"smaller than one record slot ({format_size(slot_bytes)})")
        self.slot_bytes = slot_bytes
        total = _memory_bytes()
        if total and num_slots * slot_bytes > total:
            raise ConfigError("tiers.host.capacity", format_size(capacity),
                              f"more than this machine's memory ({format_size(total)})")
        try:
            self.slab = AlignedBuffer(num_slots * slot_bytes)
        except OSError as exc:
            raise ConfigError("tiers.host.capacity", format_size(capacity),
                              f"cannot allocate it: {exc.strerror or exc}") from exc
        self.table = SlotTable([num_slots])
        self._populating = threading.Event()
        self._populating.set()
        threading.Thread(target=_populate, args=(self.slab.address, self.slab.nbytes, self._populating),
                         name="kvstore-dram-populate", daemon=True).start()

    def slot_view(self, slot: int) -> memoryview:
        start = slot * self.slot_bytes
        return self.slab.view[start : start + self.slot_bytes]

    def write(self, slot: int, header: RecordHeader, payload: memoryview) -> None:
        """Fill a reserved slot with a record (caller holds no lock: this is a copy)."""
        view = self.slot_view(slot)
        pack_header(header, view)
        copy_bytes(view[HEADER_BLOCK : HEADER_BLOCK + len(payload)], payload)

    def payload(self, slot: int, key: bytes, nbytes: int) -> memoryview | None:
        """A pinned slot's payload, or None if the slot holds something else.

        Only the key and length are checked: the header and payload checksums were
        computed from, or verified against, these very bytes when they entered the
        slab, and a DRAM get must stay close to memcpy speed for small chunks.
        """
        view = self.slot_view(slot)
        if view[KEY_OFFSET : KEY_OFFSET + len(key)] != key or read_payload_len(view) != nbytes:
            return None
        return view[HEADER_BLOCK : HEADER_BLOCK + nbytes]

    def close(self) -> None:
        self._populating.clear()
        self.slab.close()


def _memory_bytes() -> int:
    """MemTotal, 0 where /proc/meminfo cannot say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in, writable, contents untouched
_POPULATE_STEP = 64 << 20


def _populate(address: int, nbytes: int, running: threading.Event) -> None:
    """Fault the slab in, a step at a time, until done or the tier closes. Through
    ctypes so the GIL is free meanwhile; a kernel without it just skips this."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for offset in range(0, nbytes, _POPULATE_STEP):
        if not running.is_set() or madvise(address + offset, min(_POPULATE_STEP, nbytes - offset),
                                           _MADV_POPULATE_WRITE) != 0:
            return
