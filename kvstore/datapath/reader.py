"""Disk reads: each chunk read into its destination, verified as it lands, promoted.

A read's destination is, in order of preference:
- a DRAM slot (promotion): the whole record lands there; once verified, the slot is
  published and the payload copied to the caller (a get) or left for later (a prefetch);
- the caller's buffer itself, when kvstore owns it (regions.py): the header block
  lands in a small header buffer and the payload straight in the caller's memory,
  verified in place, no copy;
- a staging buffer (staging.py), verified there and copied to the caller.
Verification (header checksum, the key asked for, the length, the payload's xxh3)
runs on the reading thread as each read completes, while the next reads are in
flight; the hash releases the GIL (checksum.py). Anything that does not verify is a
counted miss and its disk record leaves the index. A read still in flight at its
deadline may land later, so its destination is retired, never reused.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field

from kvstore.datapath.prefetch_ledger import PrefetchLedger
from kvstore.format.record import HEADER_BLOCK, MissReason, RecordHeader, check_record
from kvstore.io.base import TIMED_OUT
from kvstore.io.copier import copy_bytes
from kvstore.io.regions import DirectRegions, Region
from kvstore.io.staging import StagingPool
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.dram import HostTier
from kvstore.tiers.slots import Pins, Reservation
from kvstore.tiers.stats import Stats


@dataclass
class _Read:
    """One chunk's read: where it lands, and what to settle afterwards."""

    index: int  # into the keys asked for
    slot: int  # disk slot
    buffers: list[memoryview]
    payload: memoryview  # where the payload lands (inside buffers)
    reservation: Reservation | None = None  # DRAM slot it is promoted into
    staged: memoryview | None = None  # staging or header buffer to give back
    region: Region | None = None  # caller memory it lands in directly
    header: RecordHeader | None = field(default=None)  # set once verified
    timed_out: bool = False


class DiskReader:
    def __init__(self, disk: DiskTier, host: HostTier | None, stats: Stats, staging: StagingPool,
                 headers: StagingPool, regions: DirectRegions, ledger: PrefetchLedger, *,
                 chunk_bytes: int, timeout_s: float, staging_wave: int,
                 reserve_host: Callable[[bool], Reservation | None],
                 take_over: Callable[[list[Reservation]], list[bool]]) -> None:
        self.disk = disk
        self.host = host
        self.stats = stats
        self.staging = staging
        self.headers = headers
        self.regions = regions
        self.ledger = ledger
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.staging_wave = staging_wave  # staging buffers one wave may hold
        # A DRAM slot to promote into: (may a victim be written down first?) -> reservation.
        self._reserve_host = reserve_host
        self._take_over = take_over  # writes such victims down, then the slots are ours

    def read(self, keys: Sequence[bytes], pins: Pins, outs: Sequence[memoryview] | None,
             promote: bool, ok: list[bool], wave_chunks: int | None = None) -> None:
        """Read the pinned disk hits into `outs` (None: a prefetch, promotion only),
        setting ok[index] for each chunk served; waves bound the staging memory used
        (and, with `wave_chunks`, the chunks in flight)."""
        start = 0
        while start < len(pins.hits):
            end, staged = start, 0
            while end < len(pins.hits) and staged < self.staging_wave and (
                    wave_chunks is None or end - start < wave_chunks):
                staged += self._needs_staging(pins.hits[end][0], outs, promote)
                end += 1
            self._wave(keys, pins, pins.hits[start:end], outs, promote, ok)
            start = end

    def _needs_staging(self, index: int, outs: Sequence[memoryview] | None, promote: bool) -> bool:
        if outs is None or (promote and self.host is not None):
            return False
        return self.regions.find(outs[index]) is None

    def _plan(self, index: int, slot: int, outs: Sequence[memoryview] | None,
              promote: bool, stack: ExitStack) -> _Read | None:
        """Choose one chunk's destination; every resource taken is given back by `stack`
        unless settled first."""
        if promote and self.host is not None:
            # A get never waits for a victim's disk write; a prefetch (in the background) may.
            reservation = self._reserve_host(outs is None)
            if reservation is not None:
                stack.enter_context(reservation)
                view = self.host.slot_view(reservation.slot)
                return _Read(index, slot, [view], view[HEADER_BLOCK : HEADER_BLOCK + self.chunk_bytes],
                             reservation=reservation)
        if outs is None:
            return None  # a prefetch with no DRAM slot to fill: nothing to do
        region = self.regions.find(outs[index])
        if region is not None and self.chunk_bytes % HEADER_BLOCK == 0:
            header = self.headers.acquire()
            return _Read(index, slot, [header, outs[index]], outs[index], staged=header, region=region)
        image = self.staging.acquire()
        return _Read(index, slot, [image], image[HEADER_BLOCK : HEADER_BLOCK + self.chunk_bytes],
                     staged=image)

    def _wave(self, keys: Sequence[bytes], pins: Pins, hits: Sequence[tuple[int, int]],
              outs: Sequence[memoryview] | None, promote: bool, ok: list[bool]) -> None:
        with ExitStack() as stack:
            planned: list[_Read | None] = []
            promoting = promote and self.host is not None
            for i, slot in hits:
                planned.append(self._plan(i, slot, outs, promoting, stack))
                if promoting and (planned[-1] is None or planned[-1].reservation is None):
                    promoting = False  # no DRAM slot for this one: none for the rest either
            demoting = [r.reservation for r in planned if r and r.reservation and r.reservation.victim]
            if demoting:
                usable = dict(zip(map(id, demoting), self._take_over(demoting), strict=True))
                planned = [r if r is None or r.reservation is None or usable.get(id(r.reservation), True)
                           else None for r in planned]
            reads = [r for r in planned if r is not None]
            for read in reads:
                if read.staged is not None:
                    pool = self.headers if read.region is not None else self.staging
                    stack.callback(self._give_back, pool, read)

            started = time.perf_counter()

            def verify(j: int, result: int) -> None:
                self.stats.observe("disk.read", time.perf_counter() - started)
                read = reads[j]
                if result != sum(len(b) for b in read.buffers):
                    self.stats.miss("disk", MissReason.IO_ERROR,
                                    f"{self.disk.describe(read.slot)}: result {result}")
                    return
                header, reason = check_record(read.buffers[0][:HEADER_BLOCK], read.payload,
                                              keys[read.index])
                if reason is None and header is not None and header.payload_len != self.chunk_bytes:
                    reason = MissReason.BAD_HEADER
                if reason is not None:
                    self.stats.miss("disk", reason, self.disk.describe(read.slot))
                    return
                if outs is not None and read.region is None:
                    copy_bytes(outs[read.index], read.payload)
                read.header = header

            results = self.disk.read([r.slot for r in reads], [r.buffers for r in reads],
                                     self.timeout_s, verify)
            for read, result in zip(reads, results, strict=True):
                self._settle(read, result, keys[read.index], pins, ok)
        served = [r for r in reads if r.header is not None]
        if outs is None:
            self.ledger.promoted(keys[r.index] for r in served)
        else:
            self.stats.add("disk.hits", len(served))
        self.stats.add("disk.bytes_read", self.disk.slot_bytes * sum(r > 0 for r in results))

    def _settle(self, read: _Read, result: int, key: bytes, pins: Pins, ok: list[bool]) -> None:
        if result == TIMED_OUT:
            self.stats.miss("disk", MissReason.TIMEOUT, self.disk.describe(read.slot))
            # The device may still write into the destination later: never reuse it.
            read.timed_out = True
            if read.reservation is not None:
                read.reservation.retire()
                self.stats.add("host.slots_retired")
            if read.region is not None:
                self.regions.retire(read.region)
            return
        if read.header is None:
            pins.drop(key, read.slot)  # unreadable or wrong: never serve it again
            return
        ok[read.index] = True
        if read.reservation is not None:
            parent = None if read.header.parent == bytes(16) else read.header.parent
            read.reservation.publish(key, parent, read.header.seq)

    @staticmethod
    def _give_back(pool: StagingPool, read: _Read) -> None:
        """Return a staging or header buffer; one a late read may still land in is retired."""
        assert read.staged is not None
        (pool.retire if read.timed_out else pool.release)(read.staged)
