"""Memory a disk read may land in directly, skipping the bounce copy.

A read that misses its deadline may still be written by the device later, when the
caller has long reused the buffer for another chunk: wrong KV, silently. So reads go
straight into a caller's buffer only when kvstore owns that memory and can retire it:
the read buffers `TieredStore.buffers()` hands out and the service's client windows.
A region whose read was abandoned is retired: it is never a direct destination
again, and whoever handed it out (the service) replaces it. Any other buffer gets a
bounce buffer (staging.py) and a copy.
"""

from __future__ import annotations

import bisect
import ctypes
import threading
from dataclasses import dataclass

from kvstore.format.record import BLOCK


@dataclass(eq=False)
class Region:
    address: int
    nbytes: int
    owner: object  # keeps the memory alive (an AlignedBuffer, an mmap)
    retired: bool = False


def address_of(view: memoryview) -> int:
    """Start address of a writable contiguous buffer."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class DirectRegions:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._regions: list[Region] = []
        self._ever_retired = False  # retiring is rare (a missed deadline): checks skip it till then

    def add(self, address: int, nbytes: int, owner: object) -> Region:
        region = Region(address, nbytes, owner)
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
        """The region (live or retired) holding all of `view`, if any."""
        address = address_of(view)
        with self._lock:
            at = bisect.bisect(self._starts, address) - 1
            region = self._regions[at] if at >= 0 else None
        if region is None or address + len(view) > region.address + region.nbytes:
            return None
        return region

    def find(self, view: memoryview) -> Region | None:
        """The live region holding all of `view`, if it is page-aligned (O_DIRECT)."""
        region = self.holding(view)
        if region is None or region.retired or address_of(view) % BLOCK or len(view) % BLOCK:
            return None
        return region

    def retire(self, region: Region) -> None:
        """A read into it may still land: never read into it again (its owner is kept)."""
        region.retired = True
        self._ever_retired = True

    def retired(self, view: memoryview) -> bool:
        """Whether `view` lies in a retired region (a get must not write into it)."""
        if not self._ever_retired:
            return False
        region = self.holding(view)
        return region is not None and region.retired
