"""TieredStore: the one small API over the DRAM and disk tiers.

Chunks enter DRAM (`put_many`); DRAM victims go down to disk through the bounded
write-behind queue; disk hits are promoted back into DRAM. Every tier's slots are
tracked by a SlotTable under the store's single lock, which guards bookkeeping
only: copies and I/O run outside it, on slots pinned for the duration.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.admission import AdmissionFilter
from kvstore.aligned import byte_view, copy_bytes
from kvstore.config import StoreConfig, load_config
from kvstore.devices import DATA_FILE, DevicePlan
from kvstore.disk_tier import DiskTier, DiskWrite, RecoveryReport
from kvstore.errors import ShapeError
from kvstore.health_monitor import HealthMonitor
from kvstore.host_tier import HostTier
from kvstore.io import IoEngine, make_engine
from kvstore.io.base import TIMED_OUT
from kvstore.nvmeof.tier import namespace_plans
from kvstore.record import (
    HEADER_BLOCK,
    MissReason,
    RecordHeader,
    check_record,
    pack_header,
    payload_checksum,
    record_bytes,
)
from kvstore.staging import StagingPool
from kvstore.stats import Stats
from kvstore.writeback import WriteBehind

log = logging.getLogger(__name__)
_STAGING_BYTES = 256 << 20  # bound on staging memory one disk-read wave may use


@dataclass(frozen=True)
class Lookup:
    """How many leading chunks are present, and the tier ('host', 'disk' or 'nvmeof') of each."""

    count: int
    tiers: tuple[str, ...]

    @property
    def resident(self) -> int:
        """Leading chunks already in DRAM: what a get serves without touching a device."""
        return next((i for i, tier in enumerate(self.tiers) if tier != "host"), self.count)


class TieredStore:
    def __init__(
        self,
        config: StoreConfig | dict[str, Any] | str,
        chunk_bytes: int,
        *,
        namespace: bytes = bytes(16),
        dtype: str = "uint8",
        shape: tuple[int, ...] = (),
        file_name: str = DATA_FILE,
        engine: IoEngine | None = None,
    ) -> None:
        if chunk_bytes <= 0:
            raise ShapeError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.config = load_config(config)
        self.chunk_bytes = chunk_bytes
        self.slot_bytes = record_bytes(chunk_bytes)
        self.namespace = namespace
        self.dtype, self.shape = dtype, shape
        self.stats = Stats()
        self._lock = threading.Lock()
        io = self.config.io
        self._owns_engine = engine is None
        self.engine = engine or make_engine(io.engine, io.queue_depth)
        self.host: HostTier | None = None
        self.disk: DiskTier | None = None
        # (key, DRAM slot, move): move frees the DRAM slot once on disk (an eviction);
        # otherwise the chunk stays in DRAM too (write_through).
        self._writeback: WriteBehind[tuple[bytes, int, bool]] | None = None
        self._admission = AdmissionFilter(self.config.disk_min_seen)
        self._monitor: HealthMonitor | None = None
        # Keys promoted by prefetch and not read since: a read counts prefetch.used, an
        # eviction first counts prefetch.wasted_bytes (the read bought nothing).
        self._prefetched: set[bytes] = set()
        try:
            if self.config.host is not None:
                self.host = HostTier(self.config.host.capacity, self.slot_bytes)
            plans = [DevicePlan(d.path, d.capacity) for d in self.config.disk]
            if self.config.nvmeof is not None:
                plans += namespace_plans(self.config.nvmeof)
            if plans:
                self.disk = DiskTier(plans, self.slot_bytes, self.engine, lock=self._lock,
                                     stats=self.stats, timeout_s=io.timeout_s,
                                     breaker_threshold=io.breaker_threshold, file_name=file_name)
        except BaseException:
            self._close_tiers()
            raise
        self.recovery = self.disk.recover(io.timeout_s) if self.disk else RecoveryReport()
        if self.disk is not None:
            interval = min(io.breaker_cooldown_s, self.config.nvmeof.health_interval_s
                           if self.config.nvmeof else 1.0)
            self._monitor = HealthMonitor(self.disk, interval, io.breaker_cooldown_s)
        self._seq = itertools.count(self.recovery.max_seq + 1)
        self._wave = max(io.queue_depth, min(2 * io.queue_depth, _STAGING_BYTES // self.slot_bytes))
        self._staging = StagingPool(self.slot_bytes, min(self._wave, io.queue_depth))
        if self.host and self.disk and self.config.write_behind_chunks:
            self._writeback = WriteBehind(self._demote, self.config.write_behind_chunks,
                                          batch=io.queue_depth)

    # -- queries -------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> Lookup:
        tiers = []
        with self._lock:
            for key in keys:
                if self.host and key in self.host.table.index:
                    tiers.append("host")
                elif self.disk and (slot := self.disk.table.index.get(key)) is not None:
                    tiers.append(self.disk.kind_of(slot))
                else:
                    break
        return Lookup(len(tiers), tuple(tiers))

    def contains(self, key: bytes) -> bool:
        return self.lookup([key]).count == 1

    # -- reads ---------------------------------------------------------------------

    def get_many(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[bool]:
        """Read chunks into caller buffers; result i tells whether out[i] holds chunk i.

        A False entry is a miss (absent, or did not verify): out[i] is then
        unspecified and the caller must recompute that chunk.
        """
        views = self._views(outs, len(keys))
        ok = [False] * len(keys)
        host_hits: list[tuple[int, int]] = []
        disk_hits: list[tuple[int, int]] = []
        with self._lock:
            for i, key in enumerate(keys):
                if self.host and (slot := self.host.table.index.get(key)) is not None:
                    self.host.table.pin(slot)
                    host_hits.append((i, slot))
                elif self.disk and (slot := self.disk.table.index.get(key)) is not None:
                    self.disk.table.pin(slot)
                    disk_hits.append((i, slot))
            for tier in (self.host, self.disk):
                if tier is not None:
                    tier.table.lru.touch_chain(keys)
        if host_hits:
            self._read_host(keys, views, host_hits, ok)
        for start in range(0, len(disk_hits), self._wave):
            self._read_disk(keys, views, disk_hits[start : start + self._wave], ok,
                            promote=self.config.promote_on_hit)
        if self._admission.min_seen > 1:
            with self._lock:
                for key, served in zip(keys, ok, strict=True):
                    if served:
                        self._admission.see(key)
        self.stats.add("get.chunks", len(keys))
        self.stats.add("get.hits", sum(ok))
        return ok

    def _read_host(self, keys: Sequence[bytes], views: list[memoryview],
                   hits: list[tuple[int, int]], ok: list[bool]) -> None:
        assert self.host is not None
        for i, slot in hits:
            started = time.perf_counter()
            ok[i] = self.host.read(slot, keys[i], views[i])
            self.stats.observe("host.read", time.perf_counter() - started)
        used = 0
        with self._lock:
            for i, slot in hits:
                self.host.table.unpin(slot)
                if not ok[i] and self.host.table.index.get(keys[i]) == slot:
                    self.host.table.unpublish(keys[i])
                if ok[i] and keys[i] in self._prefetched:
                    self._prefetched.discard(keys[i])
                    used += 1
        if used:
            self.stats.add("prefetch.used", used)
        served = sum(ok[i] for i, _ in hits)
        for i, slot in hits:
            if not ok[i]:
                self.stats.miss("host", MissReason.WRONG_KEY, f"slot {slot}")
        self.stats.add("host.hits", served)
        self.stats.add("host.bytes_read", served * self.chunk_bytes)

    def _read_disk(self, keys: Sequence[bytes], views: list[memoryview] | None,
                   hits: list[tuple[int, int]], ok: list[bool], promote: bool) -> None:
        """One wave of disk reads: each into a DRAM slot (promotion) or staging, then
        verified and copied to views[index] (views None: a prefetch, promotion only)."""
        assert self.disk is not None
        promote_to: list[int | None] = []
        with self._lock:
            for _ in hits:
                reserved = self._reserve_host() if promote and self.host is not None else None
                promote_to.append(reserved)
        dests = [self.host.slot_view(h) if h is not None and self.host else self._staging.acquire()
                 for h in promote_to]
        headers: list[RecordHeader | None] = [None] * len(hits)

        started = time.perf_counter()

        def verify_and_copy(j: int, result: int) -> None:
            self.stats.observe("disk.read", time.perf_counter() - started)
            index, slot = hits[j]
            if result != self.slot_bytes:
                self.stats.miss("disk", MissReason.IO_ERROR, f"{self.disk.describe(slot)}: result {result}")
                return
            dest = dests[j]
            header, reason = check_record(dest[:HEADER_BLOCK], dest[HEADER_BLOCK:], keys[index])
            if reason is None and header is not None and header.payload_len != self.chunk_bytes:
                reason = MissReason.BAD_HEADER
            if reason is not None:
                self.stats.miss("disk", reason, self.disk.describe(slot))
                return
            if views is not None:
                copy_bytes(views[index], dest[HEADER_BLOCK : HEADER_BLOCK + self.chunk_bytes])
            headers[j] = header
            ok[index] = True

        results = self.disk.read_slots([slot for _, slot in hits], dests,
                                       self.config.io.timeout_s, verify_and_copy)
        with self._lock:
            for j, (index, slot) in enumerate(hits):
                key, header = keys[index], headers[j]
                self.disk.table.unpin(slot)
                if results[j] == TIMED_OUT:
                    self.stats.miss("disk", MissReason.TIMEOUT, f"slot {slot}")
                elif header is None and self.disk.table.index.get(key) == slot:
                    self.disk.table.unpublish(key)  # unreadable or wrong: never serve it again
                host_slot = promote_to[j]
                if host_slot is not None and self.host is not None:
                    if header is not None:
                        self.host.table.publish(host_slot, key, header.parent, header.seq)
                    if results[j] == TIMED_OUT:
                        # The kernel may still write into this DRAM slot: keep it pinned
                        # (never reused) rather than let a late read overwrite a new record.
                        self.stats.add("host.slots_retired")
                    else:
                        self.host.table.unpin(host_slot)
                elif results[j] == TIMED_OUT:
                    self._staging.retire(dests[j])
                else:
                    self._staging.release(dests[j])
        if views is not None:  # a prefetch counts as prefetch.chunks, its get as a host hit
            self.stats.add("disk.hits", sum(h is not None for h in headers))
        self.stats.add("disk.bytes_read", self.slot_bytes * sum(r > 0 for r in results))

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Promote the leading run of `keys` that is on disk into DRAM, ahead of the get
        that will want it (a request waiting to be scheduled); chunks already in DRAM
        are touched so eviction keeps them. Returns chunks promoted."""
        if self.host is None or self.disk is None:
            return 0
        hits: list[tuple[int, int]] = []
        with self._lock:
            self.host.table.lru.touch_chain(keys)
            for i, key in enumerate(keys):
                if key in self.host.table.index:
                    continue
                slot = self.disk.table.index.get(key)
                if slot is None:
                    break
                self.disk.table.pin(slot)
                hits.append((i, slot))
        ok = [False] * len(keys)
        wave = max(1, self.config.prefetch_inflight // self.slot_bytes)  # the cap on bytes in flight
        for start in range(0, len(hits), wave):
            self._read_disk(keys, None, hits[start : start + wave], ok, promote=True)
        with self._lock:
            self._prefetched.update(key for key, promoted in zip(keys, ok, strict=True) if promoted)
        self.stats.add("prefetch.chunks", sum(ok))
        self.stats.add("prefetch.bytes", sum(ok) * self.chunk_bytes)
        return sum(ok)

    # -- writes --------------------------------------------------------------------

    def put_many(self, keys: Sequence[bytes], payloads: Sequence[Any],
                 parent: bytes | None = None) -> list[bool]:
        """Store chunks of one chain (head first); result i: chunk i is now stored.

        `parent` is the key of the chunk before keys[0] (None for a prompt's first
        chunk). Keys already present are kept, not rewritten (content addressing).
        """
        views = self._views(payloads, len(keys))
        parents = [parent, *keys[:-1]]
        stored = [False] * len(keys)
        to_host: list[tuple[int, int]] = []
        to_disk: list[int] = []
        with self._lock:
            for i, key in enumerate(keys):
                self._admission.see(key)
                if (self.host and key in self.host.table.index) or (
                        self.disk and key in self.disk.table.index):
                    stored[i] = True
                    continue
                slot = self._reserve_host() if self.host else None
                if slot is not None:
                    to_host.append((i, slot))
                else:
                    to_disk.append(i)
            for tier in (self.host, self.disk):
                if tier is not None:
                    tier.table.lru.touch_chain(keys)
            seq = next(self._seq)
        headers = {i: self._header(keys[i], parents[i], seq, views[i]) for i in range(len(keys))
                   if not stored[i]}
        for i, slot in to_host:
            assert self.host is not None
            self.host.write(slot, headers[i], views[i])
        with self._lock:
            for i, slot in to_host:
                assert self.host is not None
                self.host.table.publish(slot, keys[i], parents[i], seq)
                if (self._writeback is not None and self.config.write_policy == "write_through"
                        and self._admission.admit(keys[i])
                        and not self._queue_disk_write(keys[i], slot, move=False)):
                    self.stats.add("writethrough.dropped")  # written when evicted instead
                self.host.table.unpin(slot)
                stored[i] = True
        if to_host:
            self.stats.add("host.bytes_written", len(to_host) * self.chunk_bytes)
        if to_disk and self.disk:
            with self._lock:
                admitted = [i for i in to_disk if self._admission.admit(keys[i])]
            self.stats.add("disk.not_admitted", len(to_disk) - len(admitted))
            to_disk = admitted
            for start in range(0, len(to_disk), self._wave):
                self._put_disk([(i, headers[i]) for i in to_disk[start : start + self._wave]],
                               views, stored)
        elif to_disk:
            self.stats.add("put.dropped", len(to_disk))
        return stored

    def _header(self, key: bytes, parent: bytes | None, seq: int,
                payload: memoryview) -> RecordHeader:
        return RecordHeader(key=key, namespace=self.namespace, parent=parent or bytes(16),
                            seq=seq, payload_len=len(payload),
                            payload_checksum=payload_checksum(payload),
                            dtype=self.dtype, shape=self.shape)

    def _put_disk(self, items: list[tuple[int, RecordHeader]], views: list[memoryview],
                  stored: list[bool]) -> None:
        """Write chunks straight to disk (no DRAM tier, or DRAM fully pinned)."""
        assert self.disk is not None
        images = [self._staging.acquire() for _ in items]
        for (i, header), image in zip(items, images, strict=True):
            pack_header(header, image)
            copy_bytes(image[HEADER_BLOCK : HEADER_BLOCK + len(views[i])], views[i])
        self._write_disk([(h.key, h.parent, h.seq, image) for (_, h), image in zip(items, images,
                                                                                    strict=True)],
                         on_done=lambda j, ok: stored.__setitem__(items[j][0], ok))
        for image in images:
            self._staging.release(image)

    def _write_disk(self, records: list[tuple[bytes, bytes, int, memoryview]],
                    on_done: Any) -> None:
        """Reserve disk slots (striped), write in crash-safe order, publish what landed."""
        assert self.disk is not None
        table = self.disk.table
        writes: list[tuple[int, DiskWrite]] = []
        epochs: list[int] = []
        with self._lock:
            for j, (key, _, _, image) in enumerate(records):
                if key in table.index:
                    on_done(j, True)
                    continue
                reserved = table.reserve(table.next_group())
                if reserved is None:
                    self.stats.add("disk.write_dropped")
                    on_done(j, False)
                    continue
                slot, evicted = reserved
                if evicted is not None:
                    self.stats.add("disk.evictions")
                writes.append((j, DiskWrite(slot, image, self.chunk_bytes)))
                epochs.append(self.disk.epoch_of(slot))
        results = self.disk.write_records([w for _, w in writes], self.config.io.timeout_s)
        with self._lock:
            for (j, write), landed, epoch in zip(writes, results, epochs, strict=True):
                key, parent, seq, _ = records[j]
                if landed and not self.disk.still_serving(write.slot, epoch):
                    landed = False  # its device was lost meanwhile: never serve this slot
                    self.stats.add("disk.write_dropped_device_lost")
                elif landed:
                    table.publish(write.slot, key, parent, seq)
                else:
                    self.stats.miss("disk", MissReason.IO_ERROR, f"write to slot {write.slot}")
                table.unpin(write.slot)
                on_done(j, landed)
        self.stats.add("disk.bytes_written", self.slot_bytes * sum(results))

    def _reserve_host(self) -> int | None:
        """A DRAM slot for a new record; victims not yet on disk are queued for demotion."""
        assert self.host is not None
        reserved = self.host.table.reserve(0, claim_victim=self._claim_for_demotion)
        if reserved is None:
            return None
        slot, evicted = reserved
        if evicted is not None:
            self.stats.add("host.evictions")
            self._evicted_from_host(evicted)
        return slot

    def _evicted_from_host(self, key: bytes) -> None:
        """A key left DRAM (store lock held)."""
        if key in self._prefetched:
            self._prefetched.discard(key)
            self.stats.add("prefetch.wasted_bytes", self.chunk_bytes)

    def _claim_for_demotion(self, key: bytes, slot: int) -> bool:
        """A DRAM victim: queue it for disk (True), or let it be evicted now (False)."""
        if self.disk is None or key in self.disk.table.index:
            return False  # nowhere to go, or already on disk: evict now
        if not self._admission.admit(key):
            self.stats.add("disk.not_admitted")
            return False
        if self._queue_disk_write(key, slot, move=True):
            return True
        self.stats.add("writeback.dropped")
        return False

    def _queue_disk_write(self, key: bytes, slot: int, move: bool) -> bool:
        """Offer a DRAM chunk to the write-behind thread, pinning its slot (lock held)."""
        if self._writeback is not None and self._writeback.offer((key, slot, move)):
            self.host.table.pin(slot)  # type: ignore[union-attr]
            return True
        return False

    def _demote(self, items: list[tuple[bytes, int, bool]]) -> None:
        """Write-behind thread: copy DRAM chunks to disk; an eviction's slot is freed."""
        assert self.host is not None
        host = self.host.table
        records = []
        with self._lock:
            for key, slot, _ in items:
                info = host.slots[slot]
                records.append((key, info.parent or bytes(16), info.seq,
                                self.host.slot_view(slot)))

        def release(j: int, landed: bool) -> None:  # runs under self._lock
            key, slot, move = items[j]
            if landed and move and host.index.get(key) == slot:
                host.unpublish(key)
                self._evicted_from_host(key)
            host.unpin(slot)
            self.stats.add("writeback.written" if landed else "writeback.failed")

        self._write_disk(records, on_done=release)

    def _demote_all(self) -> None:
        if self.host is None or self.disk is None:
            return
        with self._lock:
            items = [(key, slot, True) for key, slot in self.host.table.index.items()
                     if key not in self.disk.table.index and self._admission.admit(key)]
            for _, slot, _ in items:
                self.host.table.pin(slot)
        for start in range(0, len(items), self._wave):
            self._demote(items[start : start + self._wave])

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove chunks from every tier (on disk too, so a restart does not revive them)."""
        removed = 0
        for key in keys:
            with self._lock:
                if self.host and self.host.table.unpublish(key) is not None:
                    removed += 1
                slot = self.disk.table.index.get(key) if self.disk else None
                if slot is not None and self.disk:
                    self.disk.table.pin(slot)
                    self.disk.table.unpublish(key)
                    removed += 1
            if slot is not None and self.disk:
                self.disk.invalidate(slot, self.config.io.timeout_s)
                with self._lock:
                    self.disk.table.unpin(slot)
        return removed

    # -- housekeeping ----------------------------------------------------------------

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait for queued demotions to reach disk."""
        return self._writeback.flush(timeout_s) if self._writeback else True

    def info(self) -> dict[str, Any]:
        tiers = []
        with self._lock:
            if self.host:
                tiers.append({"name": "host", "chunks": len(self.host.table.index),
                              "capacity_bytes": self.host.table.capacity * self.slot_bytes,
                              "used_bytes": len(self.host.table.index) * self.slot_bytes,
                              "shm": self.host.slab.shm_path, "cuda_pinned": self.host.pinned})
            if self.disk:
                tiers.append({"name": "disk", "chunks": len(self.disk.table.index),
                              "capacity_bytes": self.disk.capacity_bytes(),
                              "used_bytes": self.disk.used_bytes(),
                              "paths": [d.path for d in self.disk.devices],
                              "devices": [{"path": d.path, **h.describe()} for d, h in
                                          zip(self.disk.devices, self.disk.health, strict=True)]})
        return {"chunk_bytes": self.chunk_bytes, "slot_bytes": self.slot_bytes,
                "io_engine": self.engine.name, "tiers": tiers, "counters": self.stats.snapshot(),
                "recovery": self.recovery.__dict__}

    def close(self) -> None:
        """Drain write-behind, write DRAM-only chunks down, checkpoint, release everything.

        DRAM does not survive the process; the disk does. Writing DRAM's chunks down
        on a clean shutdown means a restarted service still serves them.
        """
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
        if self._writeback is not None:
            if not self._writeback.close(self.config.io.timeout_s):
                log.warning("close: write-behind did not drain in time; queued chunks dropped")
            self._writeback = None
        self._demote_all()
        if self.disk is not None:
            with self._lock:
                self.disk.checkpoint()
        self._close_tiers()
        self._staging.close()

    def _close_tiers(self) -> None:
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        if self.host is not None:
            self.host.close()
            self.host = None
        if self._owns_engine:
            self.engine.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _views(self, buffers: Sequence[Any], count: int) -> list[memoryview]:
        if len(buffers) != count:
            raise ShapeError(f"{count} keys but {len(buffers)} buffers")
        views = [byte_view(b) for b in buffers]
        for i, view in enumerate(views):
            if len(view) != self.chunk_bytes:
                raise ShapeError(f"buffer {i} has {len(view)} bytes; this store's chunks are "
                                 f"{self.chunk_bytes} bytes")
        return views
