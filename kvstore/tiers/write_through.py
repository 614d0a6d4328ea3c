"""Write-through queue: copies of chunks just published in DRAM go down to disk on a
background thread (`write_policy: write_through`).

The queue is bounded: `offer` refuses rather than wait (the copy is skipped and the
chunk is written when it is evicted instead), so a put never waits for this queue.
(A put can still write DRAM victims down itself: see datapath/flusher.py.) Without the
thread (`start=False`, for deterministic tests and the trace replay's checks),
`flush` writes the queue on the calling thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")
log = logging.getLogger(__name__)


class WriteThroughQueue(Generic[Item]):
    def __init__(self, write: Callable[[list[Item]], None], capacity: int, batch: int,
                 start: bool = True) -> None:
        self._write = write
        self.capacity = capacity
        self._batch = batch
        self._queue: deque[Item] = deque()
        self._busy = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kvstore-write-through", daemon=True)
        if start:
            self._thread.start()

    def offer(self, item: Item) -> bool:
        with self._cond:
            if self._stopping or len(self._queue) + self._busy >= self.capacity:
                return False
            self._queue.append(item)
            self._cond.notify_all()
            return True

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything offered so far is written; False on timeout."""
        if not self._thread.is_alive() and not self._stopping:
            while self._take_and_write():
                pass
            return True
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout_s: float) -> bool:
        flushed = self.flush(timeout_s)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return flushed

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
            self._take_and_write()

    def _take_and_write(self) -> bool:
        """Write one batch from the queue; False when it was empty."""
        with self._cond:
            if not self._queue:
                return False
            items = [self._queue.popleft() for _ in range(min(self._batch, len(self._queue)))]
            self._busy = len(items)
        try:
            self._write(items)
        except Exception:  # a failed batch is lost, never the thread
            log.exception("write-behind batch of %d chunks failed", len(items))
        finally:
            with self._cond:
                self._busy = 0
                self._cond.notify_all()
        return True
