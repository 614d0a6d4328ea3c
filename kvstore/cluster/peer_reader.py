"""Peer hits: a peer's slot read with O_DIRECT and verified like a local one (landing.py).

One more check than a local read: the record's sequence number must be the one the
index entry named, since the entry is only a hint. What differs from a local disk
read, and why this is not reader.py: a peer's slot is never pinned here (its owner may
rewrite it at any moment; verification catches that), a record that does not verify
drops nothing from any local index, faults feed the peer device's breaker
(peer_devices.py), and a promotion never writes a victim down first (a get never
waits on a disk write). The whole record lands in a DRAM slot or a staging buffer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import ExitStack

from kvstore.cluster.index import PeerHit
from kvstore.cluster.peer_devices import PeerDevice, PeerDevices
from kvstore.datapath.landing import Landing, Landings
from kvstore.format.record import MissReason
from kvstore.io.base import TIMED_OUT, IoEngine, IoRequest
from kvstore.tiers.stats import Stats


class PeerReader:
    def __init__(self, devices: PeerDevices, engine: IoEngine, landings: Landings, *, timeout_s: float,
                 peer_copies: set[bytes]) -> None:
        self.devices = devices
        self.engine = engine
        self.landings = landings
        self.stats: Stats = landings.stats
        self.ledger = landings.ledger
        self.timeout_s = timeout_s
        self._peer_copies = peer_copies  # the store's: DRAM chunks whose disk copy is a peer's

    def read(self, keys: Sequence[bytes], hits: Sequence[tuple[int, PeerHit]],
             outs: Sequence[memoryview] | None, promote: bool, ok: list[bool]) -> None:
        """Read each (index into keys, where a peer holds it) into outs[index] (None: a
        prefetch, promotion only), setting ok[index] for each chunk served; in waves of
        the I/O engine's queue depth (each staging buffer is a whole record)."""
        wave = self.engine.queue_depth
        for start in range(0, len(hits), wave):
            self._wave(keys, hits[start : start + wave], outs, promote, ok)

    def _wave(self, keys: Sequence[bytes], hits: Sequence[tuple[int, PeerHit]],
              outs: Sequence[memoryview] | None, promote: bool, ok: list[bool]) -> None:
        with ExitStack() as stack:
            located: list[tuple[int, PeerDevice, int, int]] = []
            for i, hit in hits:
                where = self.devices.locate(hit.host, hit.location)
                if isinstance(where, str):
                    self.stats.add(f"peer.miss.{where}")
                else:
                    located.append((i, *where, hit.location.seq))
            planned = self.landings.plan([i for i, *_ in located], outs, stack, promote=promote,
                                         may_demote=False, direct=False)
            reads = [(landing, device, offset, seq) for landing, (_, device, offset, seq)
                     in zip(planned, located, strict=True) if landing is not None]
            started = time.perf_counter()

            def verify(j: int, result: int) -> None:
                self.stats.observe("peer.read", time.perf_counter() - started)
                landing, device, offset, seq = reads[j]
                out = None if outs is None else outs[landing.index]
                reason = self.landings.verify(landing, result, keys[landing.index], out, seq)
                if reason is not None:
                    self.stats.miss("peer", reason, f"{device.health.label} at byte {offset}: "
                                                    f"result {result}")

            results = self.engine.run([IoRequest(device.fd, offset, landing.memory)
                                       for landing, device, offset, _ in reads], self.timeout_s, verify)
            for (landing, device, _, _), result in zip(reads, results, strict=True):
                self.devices.account(device, result, landing.nbytes)
                self._settle(landing, device, result, keys[landing.index], ok, copied=outs is not None)
        served = [keys[r[0].index] for r in reads if r[0].header is not None and ok[r[0].index]]
        if outs is None:
            self.ledger.promoted(served)
        else:
            self.stats.add("peer.hits", len(served))
        self.stats.add("peer.bytes_read", sum(r[0].nbytes for r, res in zip(reads, results, strict=True)
                                              if res > 0))

    def _settle(self, landing: Landing, device: PeerDevice, result: int, key: bytes,
                ok: list[bool], copied: bool) -> None:
        if result == TIMED_OUT:  # its memory goes back once the read lands (io/base.py)
            self.stats.miss("peer", MissReason.TIMEOUT, device.health.label)
        elif landing.header is not None:  # else the slot and buffer go back on the way out
            ok[landing.index] = True
            if landing.reservation is not None:
                self._peer_copies.add(key)  # first: once published, it may be picked as a victim
                if not self.landings.publish(landing, key):  # being deleted: never in DRAM
                    self._peer_copies.discard(key)
                    ok[landing.index] = copied  # a get has its copy; a prefetch promoted nothing
