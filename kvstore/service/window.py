"""A client's shared-memory window: memory the service creates and both map.

A window is sealed shared memory (io/memfd.py) the service makes per data client and
passes as a descriptor over the socket: a get fills its slots, a put reads them. Its
size is sealed and then the seals themselves; not against writes, since the client
writes into it too.
"""

from __future__ import annotations

import fcntl
import os

from kvstore.io.memfd import SharedMemory


class Window(SharedMemory):
    """A mapped window: `view` (writable memoryview), `address`, `nbytes`, `pages`."""

    @classmethod
    def make(cls, nbytes: int) -> tuple[Window, int]:
        """A new sealed window (service side): (window, its fd to pass on and then close)."""
        window, fd = cls.create(nbytes, "kvstore-window")
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
        except BaseException:
            window.close()
            os.close(fd)
            raise
        return window, fd

