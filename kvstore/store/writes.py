"""Writes into the store: each new chunk placed in DRAM or sent straight to disk, and deletes.

A chunk goes into a DRAM slot when placement gives one (beside the DRAM cleaner, only a
slot whose chunk is on disk already; with no cleaner, its victim written down first, in
one batch with the others'); once DRAM refuses one chunk of a chain (every slot pinned,
or the cleaner behind) the rest of the chain goes straight to disk through staging
buffers, if the disk admits it (`put.straight_to_disk`). Keys already stored are kept,
never rewritten (content addressing). Invariants: a chunk is published only once its whole
record is written; every DRAM reservation taken is published or released, whatever fails.
"""

from __future__ import annotations

from contextlib import ExitStack

from kvstore.format.record import RecordEncoder
from kvstore.store.parts import StoreParts
from kvstore.tiers.slots import Reservation


class Writes:
    def __init__(self, parts: StoreParts, encoder: RecordEncoder) -> None:
        self.parts = parts
        self.encoder = encoder

    def put(self, keys: list[bytes], views: list[memoryview], parent: bytes | None,
            seq: int, namespace: bytes | None = None) -> list[bool]:
        """Store checked chunks of one chain under sequence number `seq`, their headers naming
        `namespace` (None: the store's); True per chunk stored."""
        parts = self.parts
        parents = [parent, *keys[:-1]]
        stored = [False] * len(keys)
        parts.policy.seen(keys, parent)
        with ExitStack() as stack:
            to_dram, to_disk = self._place(keys, stored, stack)
            if to_dram:
                dram = parts.dram
                assert dram is not None
                for i, reservation in to_dram:
                    self.encoder.write(dram.slot_view(reservation.slot), keys[i], parents[i], seq, views[i],
                                       namespace)
                with dram.table.lock:
                    for i, reservation in to_dram:
                        reservation.publish(keys[i], parents[i], seq)
                        if parts.policy.write_through and parts.flusher is not None:
                            parts.flusher.write_through(keys[i], reservation.slot)
                        stored[i] = True
                parts.stats.add("dram.bytes_written", len(to_dram) * parts.chunk_bytes)
        if to_disk and parts.flusher is not None:
            if parts.placement is not None:  # a DRAM tier, but no slot it could take
                parts.stats.add("put.straight_to_disk", len(to_disk))
            admitted = [i for i in to_disk if parts.policy.admits(keys[i])]
            self._count_refused([keys[i] for i in sorted(set(to_disk) - set(admitted))])
            done = parts.flusher.put_direct(
                [(keys[i], parents[i], views[i]) for i in admitted],
                lambda image, key, parent, view: self.encoder.write(image, key, parent, seq, view, namespace))
            for i, landed in zip(admitted, done, strict=True):
                stored[i] = landed
        elif to_disk:
            parts.stats.add("put.dropped", len(to_disk))
        return stored

    def _count_refused(self, keys: list[bytes]) -> None:
        """These chunks (with no DRAM slot) were refused the disk: counted, and those the budget
        refused apart. A DRAM victim's refusal is counted when it leaves DRAM (StoreParts)."""
        stats, policy = self.parts.stats, self.parts.policy
        stats.add("disk.admission_refused", len(keys))
        over = sum(policy.refusal(key) == "budget" for key in keys)
        if over:
            stats.add("disk.budget_refused", over)

    def _place(self, keys: list[bytes], stored: list[bool],
               stack: ExitStack) -> tuple[list[tuple[int, Reservation]], list[int]]:
        """(chunks with a usable DRAM slot, chunks that go straight to disk); chunks already
        stored are marked in `stored`. Victims are written down first, in one batch."""
        dram, disk, placement = self.parts.dram, self.parts.disk, self.parts.placement
        to_dram: list[tuple[int, Reservation]] = []
        to_disk: list[int] = []
        for i, key in enumerate(keys):
            if (dram and key in dram.table) or (disk and key in disk.table):
                stored[i] = True
            elif to_disk or placement is None or (reservation := placement.reserve_for_put()) is None:
                to_disk.append(i)  # once DRAM refuses one (pinned, cleaner behind), the rest too
            else:
                stack.enter_context(reservation)  # released if anything below fails
                to_dram.append((i, reservation))
        demoting = [(i, r) for i, r in to_dram if r.victim is not None]
        if demoting:
            assert self.parts.placement is not None
            usable = self.parts.placement.take_over([r for _, r in demoting])
            lost = {i for (i, _), ok in zip(demoting, usable, strict=True) if not ok}
            to_dram = [(i, r) for i, r in to_dram if i not in lost]
            to_disk = sorted(to_disk + list(lost))
        return to_dram, to_disk

    def delete(self, keys: list[bytes]) -> int:
        """Remove chunks from every tier (on disk too, so a restart does not revive them).
        A disk record whose header cannot be zeroed stays (and is still served): what is
        indexed is what a restart would find. Returns the chunks removed (from any tier:
        a chunk with a copy in DRAM and one on disk counts once). A copy under way is not
        left to bring a chunk back (copies_in_flight.py): while its delete runs a chunk is
        not published in DRAM, and the delete waits for copies before and after it takes
        the chunk off the disk (a write down takes off the disk again what was deleted
        meanwhile; a promotion that found it on disk before is not published)."""
        parts, removed = self.parts, 0
        for key in keys:
            if parts.dram is not None:
                with parts.dram.table.lock:
                    parts.in_flight.deleting(key)
                    in_dram = parts.dram.table.unpublish(key) is not None
            else:
                parts.in_flight.deleting(key)
                in_dram = False
            try:
                self._settle(key)  # a copy on its way down, or up, goes first
                on_disk = parts.disk is not None and parts.disk.remove(key) is True
                self._settle(key)  # a promotion that found it on disk before ends unpublished
            finally:
                parts.in_flight.deleted(key)
            removed += in_dram or on_disk
        return removed

    def _settle(self, key: bytes) -> None:
        """Wait for the copies of `key` under way (each bounded by its I/O deadlines)."""
        parts = self.parts
        writing_s = (parts.flusher.longest_write_down_s if parts.flusher is not None
                     else 2 * parts.config.io.timeout_s)  # a peer's promotion: its read's deadline
        if not parts.in_flight.settle(key, writing_s):
            parts.stats.add("delete.copy_still_in_flight")  # its writer takes it off when it lands
