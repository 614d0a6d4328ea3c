"""Peer hits: a peer's slot read with O_DIRECT into a destination, verified like a local one.

The checks are reader.py's (header checksum, the key asked for, the payload length, the
payload's xxh3) plus one: the record's sequence number must be the one the index entry
named, since the entry is only a hint. What differs from a local disk read, and why
this is not reader.py: a peer's slot is never pinned here (its owner may rewrite it at
any moment; verification catches that), a record that does not verify drops nothing
from any local index, and faults feed the peer device's breaker (peer_devices.py).

Destination: a DRAM slot when hits are promoted and one is free without writing a
victim down first (a get never waits on a disk write), else a staging buffer; the
payload is copied to the caller once verified. A read past its deadline may land
later: its destination is retired, never reused.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass

from kvstore.cluster.index import PeerHit
from kvstore.cluster.peer_devices import PeerDevice, PeerDevices
from kvstore.datapath.prefetch_ledger import PrefetchLedger
from kvstore.format.record import HEADER_BLOCK, MissReason, RecordHeader, check_record
from kvstore.io.base import TIMED_OUT, IoEngine, IoRequest
from kvstore.io.copier import copy_bytes
from kvstore.io.staging import StagingPool
from kvstore.tiers.dram import HostTier
from kvstore.tiers.slots import Reservation
from kvstore.tiers.stats import Stats


@dataclass
class _PeerRead:
    index: int  # into the keys asked for
    device: PeerDevice
    offset: int
    seq: int  # what the index entry named
    image: memoryview  # where the whole record lands
    reservation: Reservation | None = None  # the DRAM slot it is promoted into
    staged: memoryview | None = None  # the staging buffer to give back
    header: RecordHeader | None = None  # set once verified


class PeerReader:
    def __init__(self, devices: PeerDevices, engine: IoEngine, host: HostTier | None, staging: StagingPool,
                 stats: Stats, ledger: PrefetchLedger, *, chunk_bytes: int, slot_bytes: int,
                 timeout_s: float, reserve_host: Callable[[bool], Reservation | None],
                 promoted: Callable[[bytes], None]) -> None:
        self.devices = devices
        self.engine = engine
        self.host = host
        self.staging = staging
        self.stats = stats
        self.ledger = ledger
        self.chunk_bytes = chunk_bytes
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self._reserve_host = reserve_host  # (may a victim be written down first?) -> reservation
        self._promoted = promoted  # told each key published into DRAM from a peer

    def read(self, keys: Sequence[bytes], hits: Sequence[tuple[int, PeerHit]],
             outs: Sequence[memoryview] | None, promote: bool, ok: list[bool]) -> None:
        """Read each (index into keys, where a peer holds it) into outs[index] (None: a
        prefetch, promotion only), setting ok[index] for each chunk served; in waves of
        the I/O engine's queue depth (each staging buffer is a whole record)."""
        wave = self.engine.queue_depth
        for start in range(0, len(hits), wave):
            self._wave(keys, hits[start : start + wave], outs, promote and self.host is not None, ok)

    def _wave(self, keys: Sequence[bytes], hits: Sequence[tuple[int, PeerHit]],
              outs: Sequence[memoryview] | None, promote: bool, ok: list[bool]) -> None:
        with ExitStack() as stack:
            reads = []
            for i, hit in hits:
                where = self.devices.locate(hit.host, hit.location)
                if isinstance(where, str):
                    self.stats.add(f"peer.miss.{where}")
                    continue
                read = self._plan(i, *where, hit.location.seq, outs, promote, stack)
                if promote and (read is None or read.reservation is None):
                    promote = False  # no DRAM slot for this one: none for the rest either
                if read is not None:
                    reads.append(read)
            started = time.perf_counter()

            def verify(j: int, result: int) -> None:
                self.stats.observe("peer.read", time.perf_counter() - started)
                read = reads[j]
                where = f"{read.device.health.label} at byte {read.offset}"
                if result != self.slot_bytes:
                    self.stats.miss("peer", MissReason.IO_ERROR, f"{where}: result {result}")
                    return
                header, reason = check_record(read.image[:HEADER_BLOCK],
                                              read.image[HEADER_BLOCK : HEADER_BLOCK + self.chunk_bytes],
                                              keys[read.index])
                if reason is None and header is not None and header.payload_len != self.chunk_bytes:
                    reason = MissReason.BAD_HEADER
                if reason is None and header is not None and header.seq != read.seq:
                    reason = MissReason.STALE
                if reason is not None:
                    self.stats.miss("peer", reason, where)
                    return
                if outs is not None:
                    copy_bytes(outs[read.index], read.image[HEADER_BLOCK : HEADER_BLOCK + self.chunk_bytes])
                read.header = header

            results = self.engine.run([IoRequest(r.device.fd, r.offset, [r.image]) for r in reads],
                                      self.timeout_s, verify)
            for read, result in zip(reads, results, strict=True):
                self.devices.account(read.device, result, self.slot_bytes)
                self._settle(read, result, keys[read.index], ok)
        served = [keys[r.index] for r in reads if r.header is not None]
        if outs is None:
            self.ledger.promoted(served)
        else:
            self.stats.add("peer.hits", len(served))
        self.stats.add("peer.bytes_read", self.slot_bytes * sum(r > 0 for r in results))

    def _plan(self, index: int, device: PeerDevice, offset: int, seq: int,
              outs: Sequence[memoryview] | None, promote: bool, stack: ExitStack) -> _PeerRead | None:
        """Where one chunk's record lands; None for a prefetch that found no DRAM slot."""
        if promote:
            assert self.host is not None
            reservation = self._reserve_host(False)
            if reservation is not None:
                stack.enter_context(reservation)  # released on the way out unless settled
                return _PeerRead(index, device, offset, seq, self.host.slot_view(reservation.slot),
                                 reservation=reservation)
        if outs is None:
            return None  # a prefetch with no DRAM slot to fill: nothing to do
        staged = self.staging.acquire()
        read = _PeerRead(index, device, offset, seq, staged, staged=staged)
        stack.callback(lambda: None if read.staged is None else self.staging.release(read.staged))
        return read

    def _settle(self, read: _PeerRead, result: int, key: bytes, ok: list[bool]) -> None:
        if result == TIMED_OUT:
            self.stats.miss("peer", MissReason.TIMEOUT, read.device.health.label)
            # The device may still write into the destination later: never reuse it.
            if read.reservation is not None:
                read.reservation.retire()
                self.stats.add("host.slots_retired")
            if read.staged is not None:
                self.staging.retire(read.staged)
                read.staged = None
            return
        if read.header is None:
            return  # the reservation and the staging buffer go back on the way out
        ok[read.index] = True
        if read.reservation is not None:
            parent = None if read.header.parent == bytes(16) else read.header.parent
            self._promoted(key)  # first: once published, it may be picked as a victim
            read.reservation.publish(key, parent, read.header.seq)
