"""Chunks going down to disk: DRAM victims, write-through copies, and puts that find
no DRAM slot (written straight from a staging buffer).

A DRAM victim that is not on disk yet (and that the disk admits) is written down
before its slot is reused: ahead of time by the DRAM cleaner (datapath/cleaner.py,
`write_down`), or, with no cleaner (`dram_clean_ahead: 0`, or a store without background
threads), by the put: the reservation that chose it carries it (DEMOTE), the flusher
writes a batch of such victims at once, and only then does the new chunk take the slot.
So a chunk never leaves DRAM unwritten while a disk device serves, and the victim stays
readable in DRAM until its disk copy is published. A put beside a cleaner, and a get's
promotion, never wait for that: they only take slots whose chunk is already on disk
(`clean_fate`). With no device in service there is nowhere to write a victim: it is
dropped, and DRAM goes on taking new chunks.

Write-through copies go through a bounded queue served by one thread
(tiers/write_through.py); with the queue full the copy is skipped (counted) and the chunk is
written when it is evicted instead. Each disk write is claimed from the write budget first
(a write the budget has no allowance for is not made: `disk.budget_refused`), reserves a
disk slot (striped over the devices in service), writes in the crash-safe order
(disk_tier.py) and publishes only if the slot's device stayed in service. A record's
image (a DRAM slot, pinned by it, or a staging buffer) is an IoBuffer (io/base.py): a
write that missed its deadline holds it until it lands, so the slot or buffer is not
rewritten under it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass

from kvstore.datapath.copies_in_flight import CopiesInFlight
from kvstore.format.record import MissReason, RecordHeader
from kvstore.io.base import IoBuffer
from kvstore.io.staging import StagingPool
from kvstore.tiers.disk import DiskTier, DiskWrite
from kvstore.tiers.dram import DramTier
from kvstore.tiers.policy import TierPolicy
from kvstore.tiers.slots import Entry, Fate, Reservation
from kvstore.tiers.write_through import WriteThroughQueue

# Makes a record (key, parent, payload) in a buffer, returning its header (RecordEncoder.write).
RecordWriter = Callable[[memoryview, bytes, "bytes | None", memoryview], RecordHeader]


@dataclass(frozen=True, slots=True)
class Record:
    """A record image on its way to disk: header block + payload."""

    key: bytes
    parent: bytes | None
    seq: int
    image: IoBuffer


class Flusher:
    def __init__(self, disk: DiskTier, dram: DramTier | None, policy: TierPolicy, staging: StagingPool, *,
                 queue_chunks: int, in_flight: CopiesInFlight, background: bool = True,
                 held_elsewhere: Callable[[bytes], bool] | None = None) -> None:
        self.disk = disk
        # A chunk whose disk copy another host holds (a cluster's peer): never written here.
        self.held_elsewhere = held_elsewhere
        self.dram = dram
        self.policy = policy
        self.stats = disk.stats
        self.staging = staging
        self.chunk_bytes = disk.chunk_bytes
        self.timeout_s = disk.timeout_s
        self.batch = disk.engine.queue_depth
        self.in_flight = in_flight
        self._queue = (WriteThroughQueue(self._write_through, queue_chunks, self.batch, start=background)
                       if dram is not None and policy.write_through else None)

    # -- DRAM victims (fates run under the DRAM table's lock) -----------------------------

    def put_fate(self, key: bytes) -> Fate:
        """A victim for a new chunk: dropped if on disk (or not admitted), else written down first."""
        return self.policy.victim_fate(key, self._settled(key), passes_over=False)

    def clean_fate(self, key: bytes) -> Fate:
        """A victim that is not written on the way (a promotion's, a put's beside the
        cleaner): only a chunk already on disk (or not admitted) goes."""
        return self.policy.victim_fate(key, self._settled(key), passes_over=True)

    def dirty(self, key: bytes) -> bool:
        """A DRAM chunk that would have to be written down before its slot is reused: not on
        disk (here or a peer's), admitted, and a device to write it to."""
        return not self._settled(key) and self.policy.admits(key)

    def _settled(self, key: bytes) -> bool:
        """Nothing to write for this chunk: it is on disk (here or a peer's), or no device
        serves to take it (a dead disk must not freeze DRAM with unwritable chunks)."""
        return (key in self.disk.table or (self.held_elsewhere is not None and self.held_elsewhere(key))
                or not self.disk.availability.any_in_service())

    def take_over(self, reservations: Sequence[Reservation]) -> list[bool]:
        """Write the victims of DEMOTE reservations to disk in one batch, then hand each
        slot over; False where a victim's write failed, or the victim was deleted meanwhile
        (that reservation is released)."""
        assert self.dram is not None
        victims = [(r, self.dram.table.entry(r.slot)) for r in reservations]
        live = [(r, entry) for r, entry in victims if entry is not None and entry.key == r.victim]
        landed = dict(zip((id(r) for r, _ in live), self.write_down([e for _, e in live]), strict=True))
        usable = []
        for reservation in reservations:
            if not landed.get(id(reservation), False):
                reservation.release()  # the victim stays in DRAM, or is gone already
                usable.append(False)
                continue
            usable.append(reservation.take_over())
            self.stats.add("dram.demoted")
        return usable

    # -- write-through copies -------------------------------------------------------------

    def write_through(self, key: bytes, slot: int) -> None:
        """A chunk just published in DRAM also goes down now (DRAM table lock held)."""
        assert self._queue is not None and self.dram is not None
        if self._queue.offer((key, slot)):
            self.dram.table.pin(slot)
        else:
            self.stats.add("writethrough.dropped")  # written when evicted instead

    def _write_through(self, items: list[tuple[bytes, int]]) -> None:
        """Background thread: copy queued DRAM chunks to disk (they stay in DRAM)."""
        assert self.dram is not None
        dram = self.dram
        try:
            entries = [dram.table.entry(slot) for _, slot in items]
            landed = self.write_down([entry for (key, _), entry in zip(items, entries, strict=True)
                                      if entry is not None and entry.key == key])
            self.stats.add("writethrough.written", sum(landed))
        finally:
            for _, slot in items:
                dram.table.unpin(slot)

    def demote_all(self) -> None:
        """Shutdown: write every admitted DRAM-only chunk down (DRAM does not survive)."""
        if self.dram is None:
            return
        table = self.dram.table
        with table.lock:
            entries = [e for e in table.entries() if self.dirty(e.key)]
            for entry in entries:
                table.pin(entry.slot)
        try:
            for start in range(0, len(entries), self.batch):
                self.write_down(entries[start : start + self.batch])
        finally:
            for entry in entries:
                table.unpin(entry.slot)

    @property
    def longest_write_down_s(self) -> float:
        """The longest `write_down` takes: each of a disk write's three phases (disk.py) and
        the zeroing of a header written after a delete, each under its own I/O deadline."""
        return 4 * self.timeout_s

    def write_down(self, entries: Sequence[Entry]) -> list[bool]:
        """Write these DRAM records (pinned by the caller) to disk; they stay in DRAM. One
        deleted from DRAM (a purge) before it is listed in flight is not written; one
        deleted while its copy was written is taken off the disk again before it is no
        longer listed, which a delete waits for (copies_in_flight.py)."""
        assert self.dram is not None
        with self.in_flight.copying([entry.key for entry in entries]):
            live = [entry for entry in entries if entry.key in self.dram.table]  # else deleted already
            records = [Record(e.key, e.parent, e.seq, self.dram.slot_memory(e.slot)) for e in live]
            written = dict(zip((e.key for e in live), self.write(records), strict=True))
            landed = [written.get(entry.key, False) for entry in entries]
            for i, entry in enumerate(entries):
                if landed[i] and entry.key not in self.dram.table:
                    self.stats.add("disk.deleted_while_written")
                    landed[i] = self.disk.remove(entry.key) is False  # False: it stays, served
        return landed

    # -- chunks with no DRAM slot ----------------------------------------------------------

    def put_direct(self, chunks: Sequence[tuple[bytes, bytes | None, memoryview]],
                   write: RecordWriter) -> list[bool]:
        """Write chunks (key, parent, payload) straight to disk, each record made in a staging
        buffer by `write` (RecordEncoder.write: payload and hash in one pass), a wave at a time."""
        stored: list[bool] = []
        for start in range(0, len(chunks), self.batch):
            with ExitStack() as stack:
                records = []
                for key, parent, payload in chunks[start : start + self.batch]:
                    image = self.staging.acquire()
                    stack.callback(image.close)
                    header = write(image.views[0], key, parent, payload)
                    records.append(Record(header.key, parent, header.seq, image))
                stored += self.write(records)
        return stored

    # -- the disk write itself ------------------------------------------------------------

    def write(self, records: Sequence[Record]) -> list[bool]:
        """Reserve disk slots (striped), write in crash-safe order, publish what landed;
        True per record now on disk (or already there). Each record's image is let go
        (closed) on the way out."""
        with ExitStack() as images:
            for record in records:
                images.callback(record.image.close)
            return self._write(records)

    def _write(self, records: Sequence[Record]) -> list[bool]:
        table = self.disk.table
        done = [record.key in table for record in records]
        fresh = [j for j, there in enumerate(done) if not there]
        claimed = self.policy.claim_writes(len(fresh))
        if claimed < len(fresh):
            self.stats.add("disk.budget_refused", len(fresh) - claimed)
        pending: list[tuple[int, Reservation, int]] = []
        landed_keys: list[bytes] = []
        with ExitStack() as stack:
            stack.callback(lambda: self.policy.settle_writes(claimed, landed_keys))  # runs last
            for j in fresh[:claimed]:
                reservation = table.reserve(table.next_group())
                if reservation is None:
                    self.stats.add("disk.write_dropped")
                    continue
                stack.enter_context(reservation)  # released on the way out unless published
                if reservation.evicted is not None:
                    self.stats.add("disk.evictions")
                pending.append((j, reservation, self.disk.availability.epoch_of(reservation.slot)))
            results = self.disk.write([DiskWrite(r.slot, records[j].image, self.chunk_bytes)
                                       for j, r, _ in pending], self.timeout_s)
            with table.lock:
                for (j, reservation, epoch), landed in zip(pending, results, strict=True):
                    if not landed:
                        self.stats.miss("disk", MissReason.IO_ERROR,
                                        f"write to {self.disk.describe(reservation.slot)}")
                    elif not self.disk.availability.still_serving(reservation.slot, epoch):
                        self.stats.add("disk.write_dropped_device_lost")  # never serve it
                    else:
                        reservation.publish(records[j].key, records[j].parent, records[j].seq)
                        done[j] = True
                        landed_keys.append(records[j].key)
        self.stats.add("disk.bytes_written", self.disk.slot_bytes * sum(results))
        self.stats.add("disk.admitted", len(landed_keys))
        return done

    def flush(self, timeout_s: float) -> bool:
        """Wait for queued write-through copies to reach disk."""
        return self._queue.flush(timeout_s) if self._queue is not None else True

    def close(self, timeout_s: float) -> bool:
        """Drain the queue (False if it did not drain in time: those stay in DRAM only)."""
        return self._queue.close(timeout_s) if self._queue is not None else True
