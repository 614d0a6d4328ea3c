"""Disk admission: write a chunk to disk only once it has been seen `min_seen` times.

A chunk computed once and never asked for again costs an SSD write and evicts a
useful one. Seen = stored (by any request that computed it) or read. Counts live in
a bounded table (least recently seen forgotten first), so memory stays fixed however
many distinct chunks pass. Not thread-safe: TierPolicy (policy.py) calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict

TRACKED_KEYS = 1 << 16


class AdmissionFilter:
    def __init__(self, min_seen: int, capacity: int = TRACKED_KEYS) -> None:
        self.min_seen = min_seen
        self.capacity = capacity
        self._seen: OrderedDict[bytes, int] = OrderedDict()

    def see(self, key: bytes) -> None:
        if self.min_seen <= 1:
            return
        self._seen[key] = self._seen.pop(key, 0) + 1
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def admit(self, key: bytes) -> bool:
        return self.min_seen <= 1 or self._seen.get(key, 0) >= self.min_seen
