"""Page-aligned memory for O_DIRECT and io_uring.

O_DIRECT needs buffer addresses, lengths and offsets aligned to the device's
logical block (we use 4096). Allocations from torch or numpy are not page
aligned, so every buffer that meets the disk comes from mmap: anonymous for
private scratch and the DRAM slab, a file under /dev/shm for the staging window
a client and the service both map.
Anonymous maps ask for transparent huge pages so a large read stays one request
instead of splitting at the block layer's segment limit.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os

from kvstore.errors import DeviceError
from kvstore.record import BLOCK, round_up

SHM_DIR = "/dev/shm"


class AlignedBuffer:
    """A page-aligned, zero-filled byte region; `view` is a writable memoryview."""

    def __init__(self, nbytes: int, shm_name: str | None = None, *, create: bool = True) -> None:
        self.nbytes = round_up(max(nbytes, BLOCK))
        self.shm_path = os.path.join(SHM_DIR, shm_name) if shm_name else None
        if self.shm_path is None:
            self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                self._map.madvise(mmap.MADV_HUGEPAGE)
        else:
            self._map = _map_shared(self.shm_path, self.nbytes, create)
        self.view = memoryview(self._map)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))

    def close(self) -> None:
        """Unmap; the shm file (if any) stays for other processes until `unlink`."""
        self.view.release()
        # A caller may still hold a view into the region; the map is then freed with it.
        with contextlib.suppress(BufferError):
            self._map.close()

    def unlink(self) -> None:
        if self.shm_path and os.path.exists(self.shm_path):
            os.unlink(self.shm_path)


def _map_shared(path: str, nbytes: int, create: bool) -> mmap.mmap:
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    except OSError as exc:
        raise DeviceError(path, f"cannot open shared-memory region: {exc.strerror}") from exc
    try:
        if os.fstat(fd).st_size < nbytes:
            if not create:
                raise DeviceError(path, f"shared-memory region is smaller than {nbytes} bytes")
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                raise DeviceError(path, f"cannot reserve {nbytes} bytes in {SHM_DIR}: "
                                  f"{exc.strerror}") from exc
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)


def pin_for_cuda(buffer: AlignedBuffer) -> bool:
    """Register the region as CUDA pinned memory when CUDA is present (faster H2D/D2H)."""
    import torch

    if not torch.cuda.is_available():
        return False
    result = torch.cuda.cudart().cudaHostRegister(buffer.address, buffer.nbytes, 0)
    return int(result) == 0


def byte_view(obj: object) -> memoryview:
    """A flat writable byte view of a buffer, numpy array or CPU torch tensor (no copy)."""
    if type(obj).__module__.startswith("torch"):
        import torch

        tensor = obj
        assert isinstance(tensor, torch.Tensor)
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("torch buffers must be contiguous CPU tensors")
        obj = tensor.view(torch.uint8).numpy()
    view = memoryview(obj)  # type: ignore[arg-type]
    if not view.contiguous:
        raise ValueError("buffers must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def copy_bytes(dst: memoryview, src: memoryview, parallel: bool = False) -> None:
    """dst[:] = src. `parallel` copies through torch on all intra-op threads: faster
    wall time (DRAM gets), but its threads spin, costing several times memcpy's CPU,
    so paths whose figure is CPU per GiB (disk reads) keep the plain memcpy."""
    if len(dst) != len(src):
        raise ValueError(f"copy of {len(src)} bytes into {len(dst)}")
    if not parallel or len(src) < 1 << 16:
        dst[:] = src
        return
    import torch

    torch.frombuffer(dst, dtype=torch.uint8).copy_(torch.frombuffer(src, dtype=torch.uint8))
