"""DRAM placement: the one owner of the DRAM slots new records go into.

Every path that puts a record into DRAM (a put, a disk read promoted, a peer read
promoted) asks here, never the slot table directly. Invariants:
- a reservation whose victim is not on disk yet (DEMOTE) is usable only once
  `take_over` has written that victim down; one whose write failed is released;
- a put takes a clean victim the cleaner (datapath/cleaner.py) wrote down ahead when its
  window has one, and DEMOTEs only when the cleaner has fallen behind;
- `reserve(may_demote=False)` (a get's promotion, a peer read) never returns such a
  reservation: it passes over chunks not on disk instead of waiting for a write;
- every chunk that leaves DRAM here is counted and told to the prefetch ledger.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.datapath.prefetch_ledger import PrefetchLedger
from kvstore.tiers.dram import DramTier
from kvstore.tiers.slots import Reservation
from kvstore.tiers.stats import Stats

if TYPE_CHECKING:
    from kvstore.datapath.cleaner import DramCleaner
    from kvstore.datapath.flusher import Flusher


class DramPlacement:
    def __init__(self, dram: DramTier, flusher: Flusher | None, cleaner: DramCleaner | None,
                 stats: Stats, ledger: PrefetchLedger) -> None:
        self.dram = dram
        self.flusher = flusher  # None: no disk tier, every victim is simply dropped
        self.cleaner = cleaner  # None: no cleaner (no disk tier, or a DRAM too small for one)
        self.stats = stats
        self.ledger = ledger

    def reserve(self, may_demote: bool = True) -> Reservation | None:
        """A DRAM slot for a new record, or None when every slot is pinned (or, without
        `may_demote`, holds a chunk not on disk yet). With `may_demote` a clean victim
        within the cleaner's window comes first; a DEMOTE only when there is none."""
        table = self.dram.table
        if self.flusher is None:
            reservation = table.reserve()
        elif not may_demote:
            reservation = table.reserve(fate=self.flusher.clean_fate)
        else:
            reservation = table.reserve(fate=self.cleaner.window_fate()) if self.cleaner else None
            if reservation is None:
                reservation = table.reserve(fate=self.flusher.put_fate)
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
