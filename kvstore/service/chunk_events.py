"""Chunks entering and leaving each tier: a bounded log that engines read to tell routers.

A KV-aware router (llm-d, Dynamo) sends a request to the engine that holds its prefix,
from the KV events engines publish, each naming a medium. The service records every
publish and unpublish of its DRAM and disk tiers here (slots.py's listeners): medium
`kvstore-dram`, `kvstore-disk` or `kvstore-nvmeof` (the shared array, which every host
of a cluster reads). An engine's connector asks for what is new since its cursor
(protocol `Events`) and turns the chunks of its own requests into the engine's events.
Bounded: a reader that falls behind by more than the log holds is told how many it lost.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from itertools import islice
from typing import TYPE_CHECKING

from kvstore.tiers.slots import Entry, SlotTable

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
        dram, disk = store.parts.dram, store.parts.disk
        if dram is not None:
            self._watch(dram.table, lambda _slot: "kvstore-dram")
        if disk is not None:
            self._watch(disk.table, lambda slot: f"kvstore-{disk.kind_of(slot)}")

    def _watch(self, table: SlotTable, medium: Callable[[int], str]) -> None:
        def record(published: bool, entry: Entry) -> None:  # the table's lock is held
            with self._lock:
                self._log.append((published, entry.key, medium(entry.slot)))
                self._next += 1

        with table.lock:
            table.listeners.append(record)

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
