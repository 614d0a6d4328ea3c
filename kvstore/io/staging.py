"""A pool of aligned record-sized buffers for disk I/O the caller's memory cannot take.

O_DIRECT needs aligned memory that caller tensors rarely are, and a read that times
out may still land later, so disk reads go into buffers we own. Each buffer is an
IoBuffer (base.py): it comes back to the pool only once its taker and every request it
was lent to have let go, so one a late I/O still holds is never handed out again before
that I/O lands; the pool grows meanwhile.
"""

from __future__ import annotations

import threading

from kvstore.io.aligned import AlignedBuffer
from kvstore.io.base import IoBuffer


class StagingPool:
    def __init__(self, buffer_bytes: int, count: int) -> None:
        self.buffer_bytes = buffer_bytes
        self._lock = threading.Lock()
        self._slabs = [AlignedBuffer(buffer_bytes * count)]
        view = self._slabs[0].view
        self._free = [view[i * buffer_bytes : (i + 1) * buffer_bytes] for i in range(count)]

    def acquire(self) -> IoBuffer:
        """A buffer of the pool, or a new one while none is free; `close` it when done."""
        with self._lock:
            if self._free:
                view = self._free.pop()
            else:
                slab = AlignedBuffer(self.buffer_bytes)
                self._slabs.append(slab)
                view = slab.view[: self.buffer_bytes]
        return IoBuffer([view], self._give_back)

    def _give_back(self, buffer: IoBuffer) -> None:
        with self._lock:
            self._free.append(buffer.views[0])

    def close(self) -> None:
        """Unmap the pool; a buffer a late I/O still holds stays mapped until it lands
        (its view keeps the map: AlignedBuffer.close)."""
        with self._lock:
            self._free.clear()
            for slab in self._slabs:
                slab.close()
