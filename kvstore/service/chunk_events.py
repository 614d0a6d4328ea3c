"""Chunks entering and leaving each tier: a bounded log that engines read to tell routers.

A KV-aware router (llm-d, Dynamo) sends a request to the engine that holds its prefix,
from the KV events engines publish, each naming a medium. The service records every
publish and unpublish of its DRAM and disk tiers here (`TieredStore.watch`): medium
`kvstore-dram`, `kvstore-disk` or `kvstore-nvmeof` (the shared array, which every host
of a cluster reads). An engine's connector asks for what is new since its cursor
(protocol `Events`) and turns the chunks of its own requests into the engine's events.
Bounded: a reader that falls behind by more than the log holds is told how many it lost.
"""

from __future__ import annotations

import threading
from collections import deque
from itertools import islice
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.store.tiered import TieredStore

CAPACITY = 1 << 16  # events kept for readers
Event = tuple[bool, bytes, str]  # (stored? else removed, chunk key, medium)


class ChunkEvents:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self._lock = threading.Lock()
        self._log: deque[Event] = deque(maxlen=capacity)
        self._next = 0  # the number of the next event

    def watch(self, store: TieredStore) -> None:
        """Record the store's DRAM and disk tiers from now on."""
        store.watch(self.record)

    def record(self, published: bool, key: bytes, tier: str) -> None:
        """One chunk stored in (or removed from) a tier named as `TieredStore.lookup` names it."""
        medium = f"kvstore-{tier}"
        with self._lock:
            self._log.append((published, key, medium))
            self._next += 1

    def since(self, cursor: int, limit: int = 4096) -> tuple[int, int, list[Event]]:
        """(the cursor to ask with next, events lost since `cursor`, up to `limit` events
        after it). A cursor below 0, or past the end (a reader of an earlier service),
        asks only for the current position."""
        with self._lock:
            first = self._next - len(self._log)
            if not 0 <= cursor <= self._next:
                return self._next, 0, []
            start = max(cursor, first)
            events = list(islice(self._log, start - first, start - first + limit))
            return start + len(events), start - cursor, events
