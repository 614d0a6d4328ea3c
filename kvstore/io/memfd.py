"""Sealed shared memory: an anonymous memfd this process creates, maps and may hand out.

Used for the service's client windows (service/window.py) and for the DRAM tier when
engines copy straight out of it (tiers/dram.py). A memfd has no name under /dev/shm
that another user could squat, guess or point elsewhere; it is sized once and sealed
against growing and shrinking (a peer that truncates it cannot make this process fault
with SIGBUS). Memory handed out read-only is also sealed against future writes
(F_SEAL_FUTURE_WRITE, Linux 5.1): this process keeps the writable map it made first,
and every map made afterwards, from any descriptor of it, can only be read. Huge pages
where the host has them (MFD_HUGETLB from `vm.nr_hugepages`, else transparent huge
pages if `shmem_enabled` allows), so a disk read into it stays one request instead of
splitting at the block layer's segment limit.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from typing import Self

import numpy as np

from kvstore.format.errors import KVStoreError

HUGE_PAGE = 2 << 20
_SEAL_SIZE = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # not named by every Python


class SharedMemory:
    """A mapped memfd: `view` (a memoryview, writable unless mapped read-only), `address`,
    `nbytes`, `pages` ("hugetlb", "thp" (asked for) or "4k": how disk reads land in it)."""

    def __init__(self, fd: int, nbytes: int, pages: str, writable: bool = True) -> None:
        self.nbytes = nbytes
        self.pages = pages
        self.writable = writable
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
        if pages != "hugetlb" and hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                self._map.madvise(mmap.MADV_HUGEPAGE)
        self.view = memoryview(self._map)
        self.address = int(np.frombuffer(self._map, np.uint8, count=1).ctypes.data)

    @classmethod
    def create(cls, nbytes: int, name: str) -> tuple[Self, int]:
        """A new memfd sealed at its size, mapped writable: (memory, its fd for the caller
        to pass on or keep, and close)."""
        for flags, pages, size in ((os.MFD_HUGETLB, "hugetlb", -(-nbytes // HUGE_PAGE) * HUGE_PAGE),
                                   (0, _thp_mode(), nbytes)):
            try:
                fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | flags)
            except OSError:
                continue  # no huge pages reserved (or no hugetlbfs): the next kind
            try:
                os.ftruncate(fd, size)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEAL_SIZE)
                return cls(fd, size, pages), fd  # (hugetlb pages are reserved by the map)
            except (OSError, BufferError) as exc:
                os.close(fd)
                if pages != "hugetlb":
                    raise KVStoreError(f"cannot create {nbytes} bytes of shared memory ({name}): "
                                       f"{exc}") from exc
            except BaseException:
                os.close(fd)
                raise
        raise KVStoreError(f"cannot create shared memory ({name}): memfd_create failed")

    @classmethod
    def attach(cls, fd: int, nbytes: int, pages: str, writable: bool = True) -> Self:
        """Map memory a peer passed (`nbytes` as it announced); the fd is closed. A descriptor
        that cannot be mapped so (a pipe, a directory, another size) is a KVStoreError: the
        peer may be anything."""
        try:
            if os.fstat(fd).st_size < nbytes:
                raise KVStoreError(f"the shared memory passed is smaller than the {nbytes} bytes "
                                   "announced")
            try:
                return cls(fd, nbytes, pages, writable)
            except (OSError, ValueError, OverflowError) as exc:
                raise KVStoreError(f"the shared memory passed cannot be mapped: {exc}") from exc
        finally:
            os.close(fd)

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):  # a view still exported elsewhere frees it with them
            self._map.close()


def seal_read_only(fd: int) -> bool:
    """Seal `fd` so that no writable map of it can be made any more (maps made before stay
    as they are) and its seals cannot change; False where the kernel cannot."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
    except OSError:
        return False
    return True


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            mode = f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "4k"
    return "thp" if mode in ("always", "within_size", "advise", "force") else "4k"

