"""Verified reads: where a record read from a device lands, and what makes it servable.

One core for local disk reads (reader.py) and peer reads (cluster/peer_reader.py). A
read's destination is, in order of preference:
- a DRAM slot (promotion, from DramPlacement): the whole record lands there; once
  verified the slot is published and the payload copied to the caller, if any;
- the caller's buffer itself, when kvstore owns it (io/regions.py) and the reader
  allows it: the header block lands in a small header buffer, the payload straight in
  the caller's memory, verified in place, no copy;
- a staging buffer, verified there and copied to the caller.
Verification (header checksum, the key asked for, the payload length, the payload's
xxh3, and the sequence number where the reader was told one) runs on the I/O thread
as each read completes; where the payload goes on to the caller, its hash and that
copy are one pass over memory (format/checksum.py). Invariants: nothing unverified reaches a caller or is
published; every resource a wave takes goes back through its ExitStack, timed out or not:
a destination is an IoBuffer (io/base.py), which its read holds until it lands, so one a
late read may still write (a DRAM slot, a staging buffer, a client's region) is reused
only after that.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field

from kvstore.datapath.copies_in_flight import CopiesInFlight
from kvstore.datapath.placement import DramPlacement
from kvstore.datapath.prefetch_ledger import PrefetchLedger
from kvstore.format.record import HEADER_BLOCK, MissReason, RecordHeader, check_record, invalidate_header
from kvstore.io.base import IoBuffer
from kvstore.io.regions import DirectRegions, Region
from kvstore.io.staging import StagingPool
from kvstore.tiers.slots import Reservation
from kvstore.tiers.stats import Stats


@dataclass
class Landing:
    """One chunk's read: the memory the I/O fills (header block first) and its settling."""

    index: int  # into the keys asked for
    memory: list[IoBuffer]  # lent to the read; closed on the wave's way out (`close`)
    payload: memoryview  # where the payload lands (inside memory)
    reservation: Reservation | None = None  # the DRAM slot it is promoted into
    region: Region | None = None  # caller memory it lands in directly
    header: RecordHeader | None = field(default=None, init=False)  # set once verified

    @property
    def nbytes(self) -> int:
        return sum(len(view) for memory in self.memory for view in memory.views)

    def close(self) -> None:
        """Its maker is done with its memory (the read may still hold it: io/base.py)."""
        for memory in self.memory:
            memory.close()


class Landings:
    def __init__(self, placement: DramPlacement | None, staging: StagingPool, headers: StagingPool,
                 regions: DirectRegions, ledger: PrefetchLedger, chunk_bytes: int,
                 in_flight: CopiesInFlight) -> None:
        self.placement = placement  # None: no DRAM tier, nothing is promoted
        self.in_flight = in_flight  # a chunk being deleted is not promoted (copies_in_flight.py)
        self.ledger = ledger  # told what each read served or promoted
        self.staging = staging
        self.headers = headers
        self.regions = regions
        self.stats: Stats = ledger.stats
        self.chunk_bytes = chunk_bytes

    def needs_staging(self, out: memoryview | None, promote: bool) -> bool:
        """Whether a read into `out` takes a staging buffer (waves bound how many)."""
        return not (out is None or (promote and self.placement is not None)
                    or self.regions.find(out) is not None)

    def plan(self, indices: Sequence[int], outs: Sequence[memoryview] | None, stack: ExitStack, *,
             promote: bool, may_demote: bool, direct: bool) -> list[Landing | None]:
        """One destination per index (None: a prefetch with no DRAM slot to fill). Once
        DRAM refuses one chunk it is not asked for the rest; victims that must be written
        down first are, in one batch, and the chunks whose victim could not be are None."""
        planned = []
        promoting = promote and self.placement is not None
        for index in indices:
            landing = self._plan_one(index, None if outs is None else outs[index], promoting,
                                     may_demote, direct, stack)
            planned.append(landing)
            if promoting and (landing is None or landing.reservation is None):
                promoting = False
        demoting = [p.reservation for p in planned if p and p.reservation and p.reservation.victim]
        if demoting:
            assert self.placement is not None
            usable = dict(zip(map(id, demoting), self.placement.take_over(demoting), strict=True))
            planned = [p if p is None or p.reservation is None or usable.get(id(p.reservation), True)
                       else None for p in planned]
        for landing in planned:
            if landing is not None and landing.reservation is not None:
                # The slot's memory, a pin a late read keeps, is taken once its victim is
                # written down: a pin taken before would keep `take_over` from owning it.
                assert self.placement is not None
                slot = self.placement.dram.slot_memory(landing.reservation.slot)
                invalidate_header(slot.views[0])  # before the read lands, in whatever order it writes
                landing.memory, landing.payload = [slot], self._payload(slot)
                stack.callback(landing.close)
        return planned

    def _plan_one(self, index: int, out: memoryview | None, promote: bool, may_demote: bool,
                  direct: bool, stack: ExitStack) -> Landing | None:
        if promote:
            assert self.placement is not None
            reservation = self.placement.reserve(may_demote)
            if reservation is not None:
                stack.enter_context(reservation)  # released on the way out unless published
                return Landing(index, [], memoryview(b""), reservation=reservation)  # memory: `plan`
        if out is None:
            return None
        region = self.regions.find(out) if direct else None
        if region is not None and self.chunk_bytes % HEADER_BLOCK == 0:
            landing = Landing(index, [self.headers.acquire(), region.lend(out)], out, region=region)
        else:
            staged = self.staging.acquire()
            landing = Landing(index, [staged], self._payload(staged))
        stack.callback(landing.close)
        return landing

    def _payload(self, record: IoBuffer) -> memoryview:
        """Where a record image's payload lies (after its header block)."""
        return record.views[0][HEADER_BLOCK : HEADER_BLOCK + self.chunk_bytes]

    def verify(self, landing: Landing, result: int, key: bytes, out: memoryview | None,
               seq: int | None = None, check_payload: bool = True) -> MissReason | None:
        """Check a completed read; on success copy the payload to `out` (unless it landed
        there) and set `landing.header`. Returns why it is a miss, or None. Without
        `check_payload` the payload's checksum is left to the reader it is handed to."""
        if result != landing.nbytes:
            return MissReason.IO_ERROR
        # Staged or promoted: the payload goes on to `out` in the same pass as its hash.
        copy_to = out if out is not None and landing.region is None else None
        header_block = landing.memory[0].views[0][:HEADER_BLOCK]
        header, reason = check_record(header_block, landing.payload, key, copy_to, check_payload)
        if reason is None and header is not None and header.payload_len != self.chunk_bytes:
            reason = MissReason.BAD_HEADER
        if reason is None and header is not None and seq is not None and header.seq != seq:
            reason = MissReason.STALE
        if reason is not None:
            return reason
        landing.header = header
        return None

    def publish(self, landing: Landing, key: bytes, keep_pin: bool = False) -> bool:
        """A verified record promoted into DRAM becomes servable there (and, with
        `keep_pin`, stays pinned for the caller: Reservation.publish); one being deleted
        is not (its slot goes back: False)."""
        reservation = landing.reservation
        if reservation is None or landing.header is None:
            return False
        with reservation.table.lock:
            if self.in_flight.being_deleted(key):
                reservation.release()
                return False
            parent = None if landing.header.parent == bytes(16) else landing.header.parent
            reservation.publish(key, parent, landing.header.seq, keep_pin)
        return True
