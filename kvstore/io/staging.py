"""A pool of aligned record-sized buffers for disk I/O the caller's memory cannot take.

O_DIRECT needs aligned memory that caller tensors rarely are, and a read that times
out may still land later, so disk reads go into buffers we own. Each buffer is an
IoBuffer (base.py): it comes back to the pool only once its taker and every request it
was lent to have let go, so one a late I/O still holds is never handed out again before
that I/O lands; the pool grows meanwhile, and shrinks back once those I/Os have landed:
it keeps at most `count` buffers free (a hung device's timed-out reads, each a chunk's
size, are not kept mapped after it recovers).
"""

from __future__ import annotations

import threading

from kvstore.io.aligned import AlignedBuffer
from kvstore.io.base import IoBuffer


class StagingPool:
    def __init__(self, buffer_bytes: int, count: int) -> None:
        self.buffer_bytes = buffer_bytes
        self._count = count
        self._lock = threading.Lock()
        self._base = AlignedBuffer(buffer_bytes * count)
        self._grown: dict[int, AlignedBuffer] = {}  # buffers mapped past `count`, by their map's id
        view = self._base.view
        self._free = [view[i * buffer_bytes : (i + 1) * buffer_bytes] for i in range(count)]

    @property
    def mapped_bytes(self) -> int:
        """Bytes of buffers mapped, free or lent."""
        with self._lock:
            return self._base.nbytes + sum(slab.nbytes for slab in self._grown.values())

    def acquire(self) -> IoBuffer:
        """A buffer of the pool, or a new one while none is free; `close` it when done."""
        with self._lock:
            if self._free:
                view = self._free.pop()
            else:
                slab = AlignedBuffer(self.buffer_bytes)
                view = slab.view[: self.buffer_bytes]
                self._grown[id(view.obj)] = slab
        return IoBuffer([view], self._give_back)

    def _give_back(self, buffer: IoBuffer) -> None:
        """Free again; past `count` free buffers a grown one is unmapped (there is one:
        the base map holds only `count`)."""
        with self._lock:
            self._free.append(buffer.views[0])
            if len(self._free) <= self._count:
                return
            at = next(i for i, view in enumerate(self._free) if id(view.obj) in self._grown)
            extra = self._free.pop(at)  # by place: views compare by their bytes
            slab = self._grown.pop(id(extra.obj))
        extra.release()
        slab.close()

    def close(self) -> None:
        """Unmap the pool; a buffer a late I/O still holds stays mapped until it lands
        (its view keeps the map: AlignedBuffer.close)."""
        with self._lock:
            self._free.clear()
            for slab in (self._base, *self._grown.values()):
                slab.close()
