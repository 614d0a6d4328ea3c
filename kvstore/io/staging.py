"""A pool of aligned record-sized buffers for disk I/O the caller's memory cannot take.

O_DIRECT needs aligned memory that caller tensors rarely are, and a read that times
out may still land later, so disk reads go into buffers we own. A buffer whose
request timed out is `retire`d (never reused); the pool then grows a new one.
"""

from __future__ import annotations

import threading

from kvstore.io.aligned import AlignedBuffer


class StagingPool:
    def __init__(self, buffer_bytes: int, count: int) -> None:
        self.buffer_bytes = buffer_bytes
        self._lock = threading.Lock()
        self._slabs = [AlignedBuffer(buffer_bytes * count)]
        view = self._slabs[0].view
        self._free = [view[i * buffer_bytes : (i + 1) * buffer_bytes] for i in range(count)]
        self._retired: list[memoryview] = []

    def acquire(self) -> memoryview:
        with self._lock:
            if self._free:
                return self._free.pop()
            slab = AlignedBuffer(self.buffer_bytes)
            self._slabs.append(slab)
            return slab.view[: self.buffer_bytes]

    def release(self, view: memoryview) -> None:
        with self._lock:
            self._free.append(view)

    def retire(self, view: memoryview) -> None:
        """The kernel may still write into `view`: keep it alive, never hand it out."""
        with self._lock:
            self._retired.append(view)

    def close(self) -> None:
        with self._lock:
            self._free.clear()
            for slab in self._slabs:
                slab.close()
