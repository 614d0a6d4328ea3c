"""Memory a disk read may land in directly, skipping the bounce copy.

A read that misses its deadline may still be written by the device later, when the
caller has long reused the buffer for another chunk: wrong KV, silently. So reads go
straight into a caller's buffer only when kvstore owns that memory and knows when the
late read lands: the read buffers `TieredStore.buffers()` hands out and the service's
client windows. A read lends its part of a region as an IoBuffer (base.py); while one
its caller gave up on is out (`late`), the region is no direct destination and a get
into it is refused, its owner (the service) drops it, and it is freed (`close`) only
once the last such read has landed. Any other buffer gets a bounce buffer
(staging.py) and a copy.
"""

from __future__ import annotations

import bisect
import ctypes
import threading
from collections.abc import Callable

from kvstore.format.record import BLOCK
from kvstore.io.base import IoBuffer


class Region:
    """Memory kvstore owns (`owner` keeps it alive: an AlignedBuffer, a window) at `address`.
    Invariant: it is freed (`close`) only once every read into it that went late (its
    caller stopped waiting) has landed; a read whose caller still waits is that caller's,
    done before the caller returns, so its owner does not close it under one."""

    def __init__(self, address: int, nbytes: int, owner: object,
                 went_late: Callable[[], None] | None = None) -> None:
        self.address = address
        self.nbytes = nbytes
        self.owner = owner
        self.late = 0  # reads into it whose caller stopped waiting, not landed yet
        self._went_late = went_late  # told as a read into it goes late
        self._lock = threading.Lock()  # for `late` and `_free`: taken only once a read went late
        self._free: Callable[[], None] | None = None  # its owner's `close`, once it is done

    def lend(self, view: memoryview) -> IoBuffer:
        """`view` (inside the region) as memory for one read."""
        return IoBuffer([view], self._back, self._late)

    def close(self, free: Callable[[], None]) -> None:
        """Its owner is done with it: `free` it now, or once the last late read into it has landed."""
        with self._lock:
            if self.late:
                self._free = free
                return
        free()

    def _late(self, _: IoBuffer) -> None:
        with self._lock:
            self.late += 1
        if self._went_late is not None:
            self._went_late()

    def _back(self, buffer: IoBuffer) -> None:
        if not buffer.late:
            return
        with self._lock:
            self.late -= 1
            free = self._free if self.late == 0 else None
            if free is not None:
                self._free = None
        if free is not None:
            free()


def address_of(view: memoryview) -> int:
    """Start address of a writable contiguous buffer."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class DirectRegions:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._regions: list[Region] = []
        self._ever_late = False  # late reads are rare (a missed deadline): `late` skips lookups till one

    def add(self, address: int, nbytes: int, owner: object) -> Region:
        region = Region(address, nbytes, owner, self._saw_late)
        with self._lock:
            at = bisect.bisect(self._starts, address)
            self._starts.insert(at, address)
            self._regions.insert(at, region)
        return region

    def remove(self, region: Region) -> None:
        with self._lock:
            at = self._regions.index(region)
            del self._starts[at], self._regions[at]

    def holding(self, view: memoryview) -> Region | None:
        """The region holding all of `view`, if any."""
        address = address_of(view)
        with self._lock:
            at = bisect.bisect(self._starts, address) - 1
            region = self._regions[at] if at >= 0 else None
        if region is None or address + len(view) > region.address + region.nbytes:
            return None
        return region

    def find(self, view: memoryview) -> Region | None:
        """The region holding all of `view`, if it is page-aligned (O_DIRECT) and no late
        read is out in it."""
        region = self.holding(view)
        if region is None or region.late or address_of(view) % BLOCK or len(view) % BLOCK:
            return None
        return region

    def _saw_late(self) -> None:
        self._ever_late = True

    def late(self, view: memoryview) -> bool:
        """Whether `view` lies in a region a late read may still land in (a get must not
        write into it)."""
        if not self._ever_late:
            return False
        region = self.holding(view)
        return region is not None and region.late > 0
