"""DRAM placement: the one owner of the DRAM slots new records go into.

Every path that puts a record into DRAM (a put, a disk read promoted, a peer read
promoted) asks here, never the slot table directly. Invariants:
- a reservation whose victim is not on disk yet (DEMOTE) is usable only once
  `take_over` has written that victim down; one whose write failed is released;
- only a put with no DRAM cleaner gets such a reservation: a put beside the cleaner, a
  get's promotion and a peer read pass over chunks not on disk instead of waiting for a
  write (the cleaner writes them; where it has fallen behind, a put's chunk finds no slot
  and goes straight to disk: the caller writes no other chunk);
- every chunk that leaves DRAM here is counted and told to the prefetch ledger.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.datapath.prefetch_ledger import PrefetchLedger
from kvstore.tiers.dram import DramTier
from kvstore.tiers.slots import Reservation
from kvstore.tiers.stats import Stats

if TYPE_CHECKING:
    from kvstore.datapath.flusher import Flusher


class DramPlacement:
    def __init__(self, dram: DramTier, flusher: Flusher | None, stats: Stats,
                 ledger: PrefetchLedger, cleaned_ahead: bool) -> None:
        self.dram = dram
        self.flusher = flusher  # None: no disk tier, every victim is simply dropped
        self.stats = stats
        self.ledger = ledger
        self.cleaned_ahead = cleaned_ahead  # a DRAM cleaner writes victims down, not puts

    def reserve(self, may_demote: bool = True) -> Reservation | None:
        """A DRAM slot for a new record, or None when every slot is pinned or holds a chunk
        not on disk yet (which only a put with no cleaner, `may_demote`, writes down)."""
        fate = None
        if self.flusher is not None:
            demotes = may_demote and not self.cleaned_ahead
            fate = self.flusher.put_fate if demotes else self.flusher.clean_fate
        reservation = self.dram.table.reserve(fate=fate)
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
