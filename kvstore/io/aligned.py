"""Page-aligned private memory for O_DIRECT and io_uring, and flat byte views of buffers.

O_DIRECT needs buffer addresses, lengths and offsets aligned to the device's
logical block (we use 4096). Allocations from torch or numpy are not page
aligned, so every buffer that meets the disk comes from an anonymous mmap (the
DRAM slab, staging, read buffers; the service's client windows are memfds, see
window.py). Maps ask for transparent huge pages so a large read stays one request
instead of splitting at the block layer's segment limit.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys

from kvstore.format.record import BLOCK, round_up


class AlignedBuffer:
    """A page-aligned, zero-filled byte region; `view` is a writable memoryview."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = round_up(max(nbytes, BLOCK))
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self.view = memoryview(self._map)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))

    def close(self) -> None:
        """Unmap (a caller may still hold a view into the region: the map then goes with it)."""
        self.view.release()
        with contextlib.suppress(BufferError):
            self._map.close()


def byte_view(obj: object) -> memoryview:
    """A flat writable byte view of a buffer, numpy array or CPU torch tensor (no copy).
    A tensor means torch is already imported: found in sys.modules, never imported here
    (an import statement per buffer costs as much as the rest of the view)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if not obj.is_cpu or not obj.is_contiguous():
            raise ValueError("torch buffers must be contiguous CPU tensors")
        obj = (obj if obj.dtype is torch.uint8 else obj.view(torch.uint8)).numpy()
    view = memoryview(obj)  # type: ignore[arg-type]
    if not view.contiguous:
        raise ValueError("buffers must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
