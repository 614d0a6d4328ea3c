"""A client's shared-memory window: memory the service creates and both map.

The service makes each window an anonymous memfd, sized, sealed against growing
and shrinking (a client that truncates its window cannot make the service's next
copy fault with SIGBUS), and passes the descriptor over the socket; there is no
file name another user could squat, guess or point elsewhere. Huge pages are used
where the host has them (MFD_HUGETLB from `vm.nr_hugepages`, else transparent
huge pages if `shmem_enabled` allows), so a disk read into a window stays one
request instead of splitting at the block layer's segment limit.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import mmap
import os

from kvstore.format.errors import KVStoreError

log = logging.getLogger(__name__)
HUGE_PAGE = 2 << 20
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class Window:
    """A mapped window: `view` (writable memoryview), `address`, `nbytes`, `pages`."""

    def __init__(self, fd: int, nbytes: int, pages: str) -> None:
        self.nbytes = nbytes
        self.pages = pages  # "hugetlb", "thp" (asked for) or "4k": how disk reads land in it
        self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        if pages != "hugetlb" and hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                self._map.madvise(mmap.MADV_HUGEPAGE)
        self.view = memoryview(self._map)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))

    @classmethod
    def create(cls, nbytes: int) -> tuple[Window, int]:
        """A new sealed window (service side): (window, its fd to pass on and then close)."""
        for flags, pages, size in ((os.MFD_HUGETLB, "hugetlb", -(-nbytes // HUGE_PAGE) * HUGE_PAGE),
                                   (0, _thp_mode(), nbytes)):
            try:
                fd = os.memfd_create("kvstore-window", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | flags)
            except OSError:
                continue  # no huge pages reserved (or no hugetlbfs): the next kind
            try:
                os.ftruncate(fd, size)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
                return cls(fd, size, pages), fd  # (hugetlb pages are reserved by the map)
            except (OSError, BufferError) as exc:
                os.close(fd)
                if pages != "hugetlb":
                    raise KVStoreError(f"cannot create a {nbytes}-byte window: {exc}") from exc
            except BaseException:
                os.close(fd)
                raise
        raise KVStoreError("cannot create a window: memfd_create failed")

    @classmethod
    def attach(cls, fd: int, nbytes: int, pages: str) -> Window:
        """Map a window the service passed (client side); the fd is closed."""
        try:
            if os.fstat(fd).st_size < nbytes:
                raise KVStoreError(f"the service's window is smaller than the {nbytes} bytes it announced")
            return cls(fd, nbytes, pages)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):  # a view still exported elsewhere frees it with them
            self._map.close()


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            mode = f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "4k"
    return "thp" if mode in ("always", "within_size", "advise", "force") else "4k"
