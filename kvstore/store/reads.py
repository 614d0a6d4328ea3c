"""Reads out of the store: DRAM hits copied out under their pins, the rest read from
disk (promoted into DRAM as the policy says) or from peers; the same read leaving the
chunks pinned in DRAM for a lease (store/leases.py); prefetches ahead of a get.

Invariants: a chunk is served only if its record verifies (DRAM: key and length under
the pin, its checksums verified when it entered; disk and peers: header, key and payload
checksum, datapath/landing.py); a slot stays pinned until its copy out has returned; a
record that does not verify is dropped from its tier's index and counted as a miss.
Each read touches its chain before and after, so promotions never evict the prompt's own
chunks and promoted ones join the chain tail-older-than-head.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvstore.datapath.reader import Unchecked
from kvstore.format.record import MissReason
from kvstore.io.copier import copy_many
from kvstore.store.parts import StoreParts
from kvstore.tiers.slots import Pins


def count_gets(parts: StoreParts, served: int) -> None:
    """Chunks a reader copied out of DRAM itself under a pin: a get's, each a hit."""
    parts.stats.add("get.chunks", served)
    parts.stats.add("get.hits", served)


class Reads:
    def __init__(self, parts: StoreParts) -> None:
        self.parts = parts

    def get(self, keys: list[bytes], views: list[memoryview]) -> list[bool]:
        """Checked keys into checked buffers; True per chunk served."""
        ok = self._read(keys, views, None)
        self.parts.stats.add("get.chunks", len(keys))
        self.parts.stats.add("get.hits", sum(ok))
        return ok

    def pin(self, keys: list[bytes], from_disk: bool = True,
            unchecked: dict[int, Unchecked] | None = None, as_get: bool = True) -> dict[int, int]:
        """The same read for a reader that copies out of the DRAM tier itself: each of
        checked `keys` served is left pinned in its DRAM slot, {index: slot}. With
        `from_disk` and promote_on_hit the disk hits are read into DRAM first (with
        `unchecked`, their payloads left for the reader to verify as it copies: recorded
        there, unpublished); peers are not asked (the caller gets the rest through `get`,
        which counts them: here only what is served; without `as_get` not yet, see
        store/leases.py). Should the read raise, what it pinned so far goes back first."""
        held: dict[int, int] = {}
        dram = self.parts.dram
        if dram is None:
            return held
        try:
            self._read(keys, None, held, from_disk, unchecked)
        except BaseException:
            for i, slot in held.items():
                if unchecked is None or i not in unchecked:  # an unchecked one's pin is its reservation's
                    dram.table.unpin(slot)
            for entry in (unchecked or {}).values():
                entry.reservation.release()
            raise
        self.parts.stats.add("dram.leased", len(held))
        if as_get:  # a pin is the get of what it serves
            count_gets(self.parts, len(held))
        return held

    def _read(self, keys: list[bytes], views: list[memoryview] | None, held: dict[int, int] | None,
              from_disk: bool = True, unchecked: dict[int, Unchecked] | None = None) -> list[bool]:
        """DRAM, then (`from_disk`) disk, then peers (only a get: `views`); with `held` (a
        pin) the served chunks stay pinned in DRAM slots, recorded there, instead of copied out."""
        parts, promote = self.parts, self.parts.policy.promote_on_hit
        ok = [False] * len(keys)
        parts.touch(keys)  # first: promoting this prompt's chunks never evicts its own
        if parts.dram is not None:
            with parts.dram.table.pinned(keys) as pins:
                self._from_dram(keys, views, pins, ok, held)
        missing = [keys[i] for i, served in enumerate(ok) if not served]
        # Copies into DRAM are listed from before they find their chunks: a delete waits for them.
        with parts.in_flight.copying(missing if promote and parts.dram is not None else []):
            if parts.reader is not None and from_disk and (views is not None or promote):
                assert parts.disk is not None
                with parts.disk.table.pinned(keys, [i for i, served in enumerate(ok) if not served]) as pins:
                    parts.reader.read(keys, pins, views, promote, ok, held=held, unchecked=unchecked)
            if parts.cluster is not None and views is not None:
                parts.cluster.read(keys, [i for i, served in enumerate(ok) if not served], views, promote, ok)
        parts.touch(keys)  # again: promoted chunks join their chain tail-older-than-head
        parts.policy.seen([key for key, served in zip(keys, ok, strict=True) if served], read=True)
        return ok

    def _from_dram(self, keys: Sequence[bytes], views: list[memoryview] | None, pins: Pins,
                   ok: list[bool], held: dict[int, int] | None) -> None:
        parts, dram = self.parts, self.parts.dram
        assert dram is not None
        copies = []
        for i, slot in pins.hits:
            payload = dram.payload(slot, keys[i], parts.chunk_bytes)
            if payload is None:
                parts.stats.miss("dram", MissReason.WRONG_KEY, f"slot {slot}")
                pins.drop(keys[i], slot)
                continue
            ok[i] = True
            if views is not None:
                copies.append((views[i], payload))
            elif held is not None:
                pins.keep(slot)  # the pin passes to the caller
                held[i] = slot
        if copies:
            started = time.perf_counter()
            copy_many(copies)  # the slots stay pinned until it returns
            # per chunk, as for disk reads: its time from the start of its batch
            parts.stats.observe("dram.read", time.perf_counter() - started, len(copies))
        served = [keys[i] for i, _ in pins.hits if ok[i]]
        parts.ledger.read(served)
        parts.stats.add("dram.hits", len(served))
        parts.stats.add("dram.bytes_read", len(served) * parts.chunk_bytes)

    def prefetch(self, keys: list[bytes]) -> int:
        """The leading run of checked `keys` on disk (or at peers) into DRAM, in waves of
        `prefetch_inflight` bytes; chunks already in DRAM are touched. Returns chunks promoted."""
        parts = self.parts
        dram, disk, reader, cluster = parts.dram, parts.disk, parts.reader, parts.cluster
        if dram is None or (reader is None and cluster is None):
            return 0
        dram.table.touch_chain(keys)
        wanted = []
        for i, key in enumerate(keys):
            if key in dram.table:
                continue
            if disk is None or key not in disk.table:
                if cluster is None:
                    break
                continue  # a peer's, read below
            wanted.append(i)
        ok = [False] * len(keys)
        wave = max(1, parts.config.prefetch_inflight // parts.slot_bytes)  # the cap on bytes in flight
        with parts.in_flight.copying([key for key in keys if key not in dram.table]):  # as `_read`
            if reader is not None:
                assert disk is not None
                with disk.table.pinned(keys, wanted) as pins:
                    reader.read(keys, pins, None, promote=True, ok=ok, wave_chunks=wave)
            if cluster is not None:  # what no local tier holds, from peers
                cluster.read(keys, [i for i, key in enumerate(keys) if parts.local_tier(key) is None],
                             None, True, ok)
        parts.stats.add("prefetch.chunks", sum(ok))
        parts.stats.add("prefetch.bytes", sum(ok) * parts.chunk_bytes)
        return sum(ok)
