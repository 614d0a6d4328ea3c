"""Slot bookkeeping shared by the DRAM and disk tiers.

A tier is an array of fixed-size slots, split into groups (one group per disk
path; the DRAM tier has one group). Invariants, all under the owning store's lock:
- A slot is in exactly one state: free (in its group's free list), reserved (being
  written, invisible to lookups), or published (in `index`, tracked by the LRU).
- A published slot is never rewritten. It leaves the index first (`unpublish`),
  and returns to the free list only once no reader or writer holds a pin on it,
  so a get never sees a half-written record and a read never races a reuse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstore.eviction import PrefixLRU


@dataclass(slots=True)
class SlotInfo:
    key: bytes | None = None
    parent: bytes | None = None
    seq: int = 0
    pins: int = 0
    published: bool = False
    ever_written: bool = False  # the slot may hold an old valid header on disk


class SlotTable:
    def __init__(self, group_sizes: list[int]) -> None:
        self.group_start = [sum(group_sizes[:i]) for i in range(len(group_sizes))]
        self.group_sizes = list(group_sizes)
        self.slots = [SlotInfo() for _ in range(sum(group_sizes))]
        self.free: list[list[int]] = [
            list(range(start + size - 1, start - 1, -1))
            for start, size in zip(self.group_start, group_sizes, strict=True)
        ]
        self.index: dict[bytes, int] = {}
        self.lru = PrefixLRU()
        self._next_group = 0
        self.disabled: set[int] = set()  # groups out of service: nothing is reserved there

    @property
    def capacity(self) -> int:
        return len(self.slots)

    def group_of(self, slot: int) -> tuple[int, int]:
        """(group, slot number within the group)."""
        for group in range(len(self.group_start) - 1, -1, -1):
            if slot >= self.group_start[group]:
                return group, slot - self.group_start[group]
        raise IndexError(slot)

    def group_slots(self, group: int) -> range:
        return range(self.group_start[group], self.group_start[group] + self.group_sizes[group])

    def next_group(self) -> int:
        """Round-robin group for striping consecutive chunks over devices in service."""
        for _ in range(len(self.group_sizes)):
            group = self._next_group
            self._next_group = (group + 1) % len(self.group_sizes)
            if group not in self.disabled:
                return group
        return 0  # all disabled: reserve() finds nothing

    def reserve(
        self, preferred_group: int = 0, claim_victim: Callable[[bytes, int], bool] | None = None
    ) -> tuple[int, bytes | None] | None:
        """A slot to write into, pinned and unpublished; evicts the LRU leaf if full.

        `claim_victim(key, slot)` may take a victim elsewhere first (the DRAM tier
        demotes it to disk): it then pins the slot and returns True, and the search
        goes on. Returns (slot, evicted key or None), or None when all are pinned.
        """
        groups = range(len(self.free))
        for group in [preferred_group, *(g for g in groups if g != preferred_group)]:
            if self.free[group] and group not in self.disabled:
                slot = self.free[group].pop()
                self.slots[slot].pins = 1
                return slot, None
        while True:
            victim = self.lru.victim(skip=lambda key: self.slots[self.index[key]].pins > 0)
            if victim is None:
                return None
            slot = self.index[victim]
            if claim_victim is None or not claim_victim(victim, slot):
                break
        self.unpublish(victim)  # unpinned, so this appends it to its free list
        self.free[self.group_of(slot)[0]].pop()
        self.slots[slot].pins = 1
        return slot, victim

    def publish(self, slot: int, key: bytes, parent: bytes | None, seq: int) -> None:
        """Make a written slot visible; an older slot of the same key is retired."""
        if key in self.index:
            self.unpublish(key)
        info = self.slots[slot]
        info.key, info.parent, info.seq = key, parent, seq
        info.published = info.ever_written = True
        self.index[key] = slot
        self.lru.add(key, parent)

    def unpublish(self, key: bytes) -> int | None:
        """Hide `key`; its slot is freed now or when its last pin goes."""
        slot = self.index.pop(key, None)
        if slot is None:
            return None
        self.lru.remove(key)
        info = self.slots[slot]
        info.published = False
        if info.pins == 0:
            self._free(slot)
        return slot

    def pin(self, slot: int) -> None:
        self.slots[slot].pins += 1

    def unpin(self, slot: int) -> None:
        info = self.slots[slot]
        info.pins -= 1
        if info.pins == 0 and not info.published:
            self._free(slot)

    def _free(self, slot: int) -> None:
        info = self.slots[slot]
        info.key = info.parent = None
        self.free[self.group_of(slot)[0]].append(slot)
