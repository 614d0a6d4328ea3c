"""The bytes of puts the store writes at once, all callers together, bounded.

A put copies its chunks into DRAM, or writes them straight to disk when DRAM has no slot
for them; either way its caller (a service client's thread) waits. Without a bound, a
burst of saves from many engines would all be under way at once, each holding a thread
and queueing its disk writes behind the others', and a slow disk would hold every
client's thread. So a put takes its bytes from `limit` first; the leading chunks that
fit are stored, the rest refused at once (`put.rejected`, never stored: a save is best
effort, its chunks are only a future miss) instead of waiting. Invariant: the bytes
taken are given back exactly once, when the put ends, however it ends.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kvstore.tiers.stats import Stats


class PutBound:
    def __init__(self, limit: int, chunk_bytes: int, stats: Stats) -> None:
        self.limit = limit
        self.chunk_bytes = chunk_bytes
        self.stats = stats
        self._taken = 0
        self._lock = threading.Lock()

    @contextmanager
    def take(self, chunks: int) -> Iterator[int]:
        """Room for up to `chunks` chunks: yields how many may be stored (the leading ones);
        the others are counted as rejected. At least one chunk is granted while nothing
        else is under way, so a put never starves behind a bound smaller than its chunk."""
        with self._lock:
            room = max(0, self.limit - self._taken) // self.chunk_bytes
            granted = min(chunks, room if self._taken else max(room, 1))
            self._taken += granted * self.chunk_bytes
        if granted < chunks:
            self.stats.add("put.rejected", chunks - granted)
        try:
            yield granted
        finally:
            with self._lock:
                self._taken -= granted * self.chunk_bytes
