"""Which chunks a prefetch promoted to DRAM that no get has read yet.

It makes prefetch's worth countable: a get that reads such a chunk counts
prefetch.used; a chunk that leaves DRAM unread counts prefetch.wasted_bytes (its
disk read bought nothing). Bounded by the DRAM tier's slot count.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kvstore.tiers.stats import Stats


class PrefetchLedger:
    def __init__(self, stats: Stats, chunk_bytes: int) -> None:
        self.stats = stats
        self._chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._unread: set[bytes] = set()

    def promoted(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            self._unread.update(keys)

    def read(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            used = [key for key in keys if key in self._unread]
            self._unread.difference_update(used)
        if used:
            self.stats.add("prefetch.used", len(used))

    def left_dram(self, key: bytes) -> None:
        with self._lock:
            if key not in self._unread:
                return
            self._unread.discard(key)
        self.stats.add("prefetch.wasted_bytes", self._chunk_bytes)
