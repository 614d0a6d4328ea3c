"""Local disk reads: pinned disk hits read in waves, each verified as it lands (landing.py).

A record that does not verify is a counted miss and leaves the index (never served
again); one that does is served to the caller and, when promoted, published in DRAM.
A read for a lease (`held`) lands in a DRAM slot only, is verified there, and the slot
stays pinned for the caller to copy out of the shared tier itself (store/leases.py);
with `unchecked` only its header, key and length are, and its slot is handed over
unpublished (`Unchecked`): the lease's reader hashes the payload as it copies it, and
the lease publishes it or drops it on that reader's word.
Waves bound the staging memory one get may hold (and, for a prefetch, the chunks in
flight). The hash releases the GIL (format/checksum.py), so verification overlaps the
reads still in flight.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

from kvstore.datapath.landing import Landing, Landings
from kvstore.format.record import MissReason, RecordHeader
from kvstore.io.base import TIMED_OUT
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.slots import Pins, Reservation
from kvstore.tiers.stats import Stats


@dataclass(frozen=True)
class Unchecked:
    """A disk hit read into a DRAM slot whose payload is not verified yet: the slot is
    reserved, pinned and unpublished (`reservation`, handed over), `header` says what the
    payload's checksum must be, and `disk_slot` where the record came from (dropped from
    the disk's index if it does not verify)."""

    reservation: Reservation
    header: RecordHeader
    disk_slot: int


class DiskReader:
    def __init__(self, disk: DiskTier, landings: Landings, *, timeout_s: float, staging_wave: int) -> None:
        self.disk = disk
        self.landings = landings
        self.stats: Stats = landings.stats
        self.ledger = landings.ledger
        self.timeout_s = timeout_s
        self.staging_wave = staging_wave  # staging buffers one wave may hold

    def read(self, keys: Sequence[bytes], pins: Pins, outs: Sequence[memoryview] | None,
             promote: bool, ok: list[bool], wave_chunks: int | None = None,
             held: dict[int, int] | None = None, unchecked: dict[int, Unchecked] | None = None) -> None:
        """Read the pinned disk hits into `outs` (None: a prefetch, promotion only),
        setting ok[index] for each chunk served. With `held` (and `outs` None) it is a
        get for a lease: held[index] is the DRAM slot each served chunk is pinned in; with
        `unchecked` too, unverified and unpublished (unchecked[index] says how to settle it)."""
        start = 0
        while start < len(pins.hits):
            end, staged = start, 0
            while end < len(pins.hits) and staged < self.staging_wave and (
                    wave_chunks is None or end - start < wave_chunks):
                index = pins.hits[end][0]
                staged += self.landings.needs_staging(None if outs is None else outs[index], promote)
                end += 1
            self._wave(keys, pins, pins.hits[start:end], outs, promote, ok, held, unchecked)
            start = end

    def _wave(self, keys: Sequence[bytes], pins: Pins, hits: Sequence[tuple[int, int]],
              outs: Sequence[memoryview] | None, promote: bool, ok: list[bool],
              held: dict[int, int] | None, unchecked: dict[int, Unchecked] | None) -> None:
        prefetch = outs is None and held is None
        with ExitStack() as stack:
            # A get never waits for a victim's disk write; a prefetch (in the background) may.
            planned = self.landings.plan([i for i, _ in hits], outs, stack, promote=promote,
                                         may_demote=prefetch, direct=True)
            reads = [(landing, slot) for landing, (_, slot) in zip(planned, hits, strict=True)
                     if landing is not None]
            started = time.perf_counter()

            def verify(j: int, result: int) -> None:
                self.stats.observe("disk.read", time.perf_counter() - started)
                landing, slot = reads[j]
                out = None if outs is None else outs[landing.index]
                reason = self.landings.verify(landing, result, keys[landing.index], out,
                                              check_payload=unchecked is None or landing.reservation is None)
                if reason is not None:
                    self.stats.miss("disk", reason, f"{self.disk.describe(slot)}: result {result}")

            results = self.disk.read([slot for _, slot in reads], [r.memory for r, _ in reads],
                                     self.timeout_s, verify)
            for (landing, slot), result in zip(reads, results, strict=True):
                self._settle(landing, slot, result, keys[landing.index], pins, ok, held, unchecked,
                             copied=outs is not None)
        served = [landing for landing, _ in reads if landing.header is not None and ok[landing.index]]
        if prefetch:
            self.ledger.promoted(keys[r.index] for r in served)
        else:
            self.stats.add("disk.hits", len(served))
        self.stats.add("disk.bytes_read", self.disk.slot_bytes * sum(r > 0 for r in results))

    def _settle(self, landing: Landing, slot: int, result: int, key: bytes, pins: Pins,
                ok: list[bool], held: dict[int, int] | None, unchecked: dict[int, Unchecked] | None,
                copied: bool) -> None:
        """Settle one read: a miss counted, or served (`copied` to the caller as it was
        verified; for a lease or a prefetch, only once published in DRAM: not a chunk
        deleted meanwhile)."""
        if result == TIMED_OUT:  # its memory goes back once the read lands (io/base.py)
            self.stats.miss("disk", MissReason.TIMEOUT, self.disk.describe(slot))
        elif landing.header is None:
            pins.drop(key, slot)  # unreadable or wrong: never serve it again
        elif unchecked is not None and held is not None and landing.reservation is not None:
            ok[landing.index] = True  # its payload is checked as the lease's reader copies it
            unchecked[landing.index] = Unchecked(landing.reservation.hand_over(), landing.header, slot)
            held[landing.index] = landing.reservation.slot
        else:
            published = self.landings.publish(landing, key, keep_pin=held is not None)
            ok[landing.index] = published or copied
            if held is not None and published and landing.reservation is not None:
                held[landing.index] = landing.reservation.slot
