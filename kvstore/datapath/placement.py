"""DRAM placement: the one owner of the DRAM slots new records go into.

Every path that puts a record into DRAM (a put, a disk read promoted, a peer read
promoted) asks here, never the slot table directly. Invariants:
- a reservation whose victim is not on disk yet (DEMOTE) is usable only once
  `take_over` has written that victim down; one whose write failed is released;
- a put beside the DRAM cleaner, a get's promotion and a peer read never get such a
  reservation: they pass over chunks not on disk instead of waiting for a write, beside
  the cleaner only among the next 2 x its window to go (a bounded walk under the DRAM
  lock, and never past the cold end for a hot chunk); where the cleaner has fallen behind
  a put finds none and its chunk goes straight to disk (the caller writes no other
  chunk), a promotion is not made. A put with no cleaner and a prefetch (in the
  background) may write victims down;
- a reservation that finds no slot beside the cleaner wakes it: what it writes makes
  slots takeable, and nothing else would wake it when no publish follows;
- every chunk that leaves DRAM here is counted and told to the prefetch ledger.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.datapath.cleaner import DramCleaner
from kvstore.datapath.prefetch_ledger import PrefetchLedger
from kvstore.tiers.dram import DramTier
from kvstore.tiers.slots import Fate, Reservation
from kvstore.tiers.stats import Stats

if TYPE_CHECKING:
    from kvstore.datapath.flusher import Flusher


class DramPlacement:
    def __init__(self, dram: DramTier, flusher: Flusher | None, stats: Stats,
                 ledger: PrefetchLedger, cleaner: DramCleaner | None) -> None:
        self.dram = dram
        self.flusher = flusher  # None: no disk tier, every victim is simply dropped
        self.stats = stats
        self.ledger = ledger
        self.cleaner = cleaner  # None: puts write their victims down themselves

    def reserve_for_put(self) -> Reservation | None:
        """A DRAM slot for a put's chunk, or None: every slot is pinned or, beside the
        cleaner, none of the next to go is on disk yet (the chunk then goes to disk)."""
        if self.flusher is None or self.cleaner is None:
            return self.reserve(may_demote=True)
        return self._reserve(self.flusher.clean_fate, self._near_cold_end())

    def reserve(self, may_demote: bool) -> Reservation | None:
        """A DRAM slot for a record read from disk or a peer, or None when every slot is
        pinned or holds a chunk not on disk yet (which a prefetch, `may_demote`, writes
        down; a get never waits for that)."""
        if self.flusher is None:
            return self._reserve(None, None)
        if may_demote:
            return self._reserve(self.flusher.put_fate, None)
        return self._reserve(self.flusher.clean_fate, self._near_cold_end())

    def _near_cold_end(self) -> int | None:
        """How far a reservation that passes over unwritten chunks looks: beside the cleaner,
        past twice its window every chunk is unwritten by design (a short walk under the DRAM
        lock); with none, as far as it takes."""
        return None if self.cleaner is None else 2 * self.cleaner.depth

    def _reserve(self, fate: Callable[[bytes], Fate] | None, most: int | None) -> Reservation | None:
        reservation = self.dram.table.reserve(fate=fate, most=most)
        if reservation is None and self.cleaner is not None:
            self.cleaner.wake()
        if reservation is not None and reservation.evicted is not None:
            self._left(reservation.evicted)
        return reservation

    def take_over(self, reservations: list[Reservation]) -> list[bool]:
        """Write DEMOTE reservations' victims down (one batch); True where the slot is now ours."""
        if not reservations:
            return []
        assert self.flusher is not None, "a DEMOTE victim needs a disk tier"
        usable = self.flusher.take_over(reservations)
        for reservation, ok in zip(reservations, usable, strict=True):
            if ok and reservation.evicted is not None:
                self._left(reservation.evicted)
        return usable

    def _left(self, key: bytes) -> None:
        self.stats.add("dram.evictions")
        self.ledger.left_dram(key)
