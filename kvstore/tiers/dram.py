"""The DRAM tier: one aligned slab carved into record-sized slots.

A slot holds the exact record image that goes to disk (header block + payload),
so demotion is one write straight from the slab and promotion one read into it,
with no re-encoding. A shared slab (the service's) is a sealed memfd (io/memfd.py)
that engine workers map read-only, so a DRAM hit is one copy from the slot into the
engine's KV blocks while the service keeps the slot pinned; it is sealed against
writable maps before any descriptor of it leaves, and where the kernel cannot seal
it so, it is never handed out. An unshared slab is private anonymous memory. Both
ask for huge pages, so a disk read into a slot stays one request. Its pages are
faulted in by a background thread at start (MADV_POPULATE_WRITE, which leaves
contents alone): otherwise the first reads into each slot pay the faults
inside io_uring submission, several times the CPU of the read itself.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

from kvstore.format.errors import ConfigError
from kvstore.format.record import (
    HEADER_BLOCK,
    KEY_OFFSET,
    read_payload_len,
)
from kvstore.format.units import format_size
from kvstore.io.aligned import AlignedBuffer
from kvstore.io.base import IoBuffer
from kvstore.io.memfd import SharedMemory, seal_read_only
from kvstore.tiers.slots import SlotTable

log = logging.getLogger(__name__)


class DramTier:
    name = "dram"

    def __init__(self, capacity: int, slot_bytes: int, shared: bool = False) -> None:
        """`shared`: the slab is memory engine workers may map read-only (`share_fd`)."""
        num_slots = capacity // slot_bytes
        if num_slots == 0:
            raise ConfigError("tiers.dram.capacity", format_size(capacity),
                              f"smaller than one record slot ({format_size(slot_bytes)})")
        self.slot_bytes = slot_bytes
        total = _memory_bytes()
        if total and num_slots * slot_bytes > total:
            raise ConfigError("tiers.dram.capacity", format_size(capacity),
                              f"more than this machine's memory ({format_size(total)})")
        self._fd: int | None = None  # the shared slab's descriptor, while it may be handed out
        self.slab: AlignedBuffer | SharedMemory
        try:
            if shared:
                self.slab, self._fd = SharedMemory.create(num_slots * slot_bytes, "kvstore-dram")
                if not seal_read_only(self._fd):
                    log.warning("this kernel cannot seal the DRAM tier against writes by others "
                                "(F_SEAL_FUTURE_WRITE): engines load through their windows instead")
                    os.close(self._fd)
                    self._fd = None
            else:
                self.slab = AlignedBuffer(num_slots * slot_bytes)
        except OSError as exc:
            raise ConfigError("tiers.dram.capacity", format_size(capacity),
                              f"cannot allocate it: {exc.strerror or exc}") from exc
        self.table = SlotTable([num_slots])
        self._populating = threading.Event()
        self._populating.set()
        threading.Thread(target=_populate, args=(self.slab.address, self.slab.nbytes, self._populating),
                         name="kvstore-dram-populate", daemon=True).start()

    def share(self) -> tuple[int, int, str] | None:
        """(a new descriptor of the slab, sealed read-only, for a client: the caller closes
        it; the slab's bytes; its page kind), or None when the slab is not shared."""
        if self._fd is None or not isinstance(self.slab, SharedMemory):
            return None
        return os.dup(self._fd), self.slab.nbytes, self.slab.pages

    def info(self) -> dict[str, Any]:
        """This tier as `kvstore info` prints it."""
        return {"name": "dram", "chunks": len(self.table),
                "capacity_bytes": self.table.capacity * self.slot_bytes,
                "used_bytes": len(self.table) * self.slot_bytes}

    def payload_offset(self, slot: int) -> int:
        """Where a slot's payload starts in the slab (as a client maps it)."""
        return slot * self.slot_bytes + HEADER_BLOCK

    def slot_view(self, slot: int) -> memoryview:
        start = slot * self.slot_bytes
        return self.slab.view[start : start + self.slot_bytes]

    def slot_memory(self, slot: int) -> IoBuffer:
        """A slot's record image for disk I/O, pinned until its maker and every request it
        is lent to have let go: a slot a late read may still write, or a late write still
        read, is neither freed nor rewritten before that I/O lands (io/base.py)."""
        self.table.pin(slot)
        return IoBuffer([self.slot_view(slot)], lambda _: self.table.unpin(slot))

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
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
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
