"""TieredStore: the one small API over the DRAM and disk tiers.

Chunks enter DRAM (`put_many`); DRAM victims go down to disk through the bounded
write-behind queue; disk hits are promoted back into DRAM. This module composes the
parts and checks input at the API edge; each concern has its own home:
  policy.py     where chunks go and when they move (shared with the trace replay)
  reader.py     disk reads: destination, verification, promotion
  flusher.py    chunks going down to disk (write-behind, write-through, direct puts)
  slots.py      each tier's slots, pins and reservations (own lock per tier)
  recover.py    the disk index at start; the checkpoint at a clean close
  cluster/      other hosts' chunks on a shared array (only with `cluster` configured)
Copies and I/O run outside every lock, on pinned or reserved slots.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.config.store import StoreConfig, load_config
from kvstore.datapath.flusher import Flusher
from kvstore.datapath.prefetch_ledger import PrefetchLedger
from kvstore.datapath.reader import DiskReader
from kvstore.devices.device import DevicePlan
from kvstore.devices.nvmeof.plans import namespace_plans
from kvstore.format.errors import BadKeyError, ShapeError
from kvstore.format.keys import KEY_BYTES
from kvstore.format.record import HEADER_BLOCK, MissReason, RecordEncoder, record_bytes
from kvstore.io import IoEngine, make_engine
from kvstore.io.aligned import AlignedBuffer, byte_view
from kvstore.io.copier import copy_many
from kvstore.io.regions import DirectRegions
from kvstore.io.staging import StagingPool
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.dram import HostTier
from kvstore.tiers.health_monitor import HealthMonitor
from kvstore.tiers.policy import TierPolicy
from kvstore.tiers.recover import RecoveryReport, checkpoint, recover
from kvstore.tiers.slots import Reservation
from kvstore.tiers.stats import Stats

if TYPE_CHECKING:
    from kvstore.cluster.node import ClusterNode

log = logging.getLogger(__name__)
_STAGING_BYTES = 256 << 20  # bound on staging memory one disk-read wave may use


@dataclass(frozen=True)
class Lookup:
    """How many leading chunks are present, and the tier ('host', 'disk', 'nvmeof' or 'peer':
    another host's device on a shared array) of each."""

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
        engine: IoEngine | None = None,
        background: bool = True,
    ) -> None:
        """`background` False starts no threads (tests): demotions are written by
        `flush()` and devices are checked by `monitor.check_once()`."""
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ShapeError(f"chunk_bytes must be a positive integer, got {chunk_bytes!r}")
        self.config = load_config(config)
        self.encoder = RecordEncoder(namespace, dtype, shape)
        self.chunk_bytes = chunk_bytes
        self.slot_bytes = record_bytes(chunk_bytes)
        self.stats = Stats()
        io = self.config.io
        self.policy = TierPolicy(promote_on_hit=self.config.promote_on_hit,
                                 write_through=self.config.write_policy == "write_through",
                                 disk_min_seen=self.config.disk_min_seen)
        self.regions = DirectRegions()
        self._ledger = PrefetchLedger(self.stats, chunk_bytes)
        self._owns_engine = engine is None
        self.engine = engine or make_engine(io.engine, io.queue_depth)
        self.host: HostTier | None = None
        self.disk: DiskTier | None = None
        self._flusher: Flusher | None = None
        self._reader: DiskReader | None = None
        self.monitor: HealthMonitor | None = None  # moves devices out of and back into service
        self.cluster: ClusterNode | None = None
        self._read_buffers: list[AlignedBuffer] = []
        wave = max(io.queue_depth, _STAGING_BYTES // self.slot_bytes)
        self._staging = StagingPool(self.slot_bytes, min(wave, io.queue_depth))
        self._headers = StagingPool(HEADER_BLOCK, io.queue_depth)
        try:
            if self.config.host is not None:
                self.host = HostTier(self.config.host.capacity, self.slot_bytes)
            plans = [DevicePlan(d.path, d.capacity) for d in self.config.disk]
            if self.config.nvmeof is not None:
                plans += namespace_plans(self.config.nvmeof)
            if plans:
                self.disk = DiskTier(plans, self.slot_bytes, chunk_bytes, self.engine, stats=self.stats,
                                     timeout_s=io.timeout_s, breaker_threshold=io.breaker_threshold)
            self.recovery = recover(self.disk) if self.disk else RecoveryReport()
            if self.config.cluster is not None:
                from kvstore.cluster.node import ClusterNode  # imports redis: only for a cluster

                self.cluster = ClusterNode(self.config, disk=self.disk, host=self.host, engine=self.engine,
                                           stats=self.stats, staging=self._staging, ledger=self._ledger,
                                           chunk_bytes=chunk_bytes, slot_bytes=self.slot_bytes,
                                           reserve_host=self._reserve_host, background=background)
        except BaseException:
            self._close_parts()
            raise
        self._seq = itertools.count(self.recovery.max_seq + 1)
        if self.disk is not None:
            self._flusher = Flusher(self.disk, self.host, self.policy, self.stats, self._staging,
                                    chunk_bytes=chunk_bytes, queue_chunks=self.config.write_behind_chunks,
                                    batch=io.queue_depth, timeout_s=io.timeout_s,
                                    background=background,
                                    held_elsewhere=self.cluster.held_elsewhere if self.cluster else None)
            self._reader = DiskReader(self.disk, self.host, self.stats, self._staging, self._headers,
                                      self.regions, self._ledger, chunk_bytes=chunk_bytes,
                                      timeout_s=io.timeout_s,
                                      staging_wave=max(1, _STAGING_BYTES // self.slot_bytes),
                                      reserve_host=self._reserve_host, take_over=self._take_over)
            interval = min(io.breaker_cooldown_s, self.config.nvmeof.health_interval_s
                           if self.config.nvmeof else 1.0)
            self.monitor = HealthMonitor(self.disk, interval, io.breaker_cooldown_s, start=background)

    # -- queries -------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> Lookup:
        """Leading chunks present, and where. A chunk moving down is published below
        before it leaves DRAM, so a lookup racing it still finds it. With a cluster, what
        the local tiers lack is looked for at the peers (one index read)."""
        keys = self._keys(keys)
        in_dram = self.host.table.index if self.host is not None else {}
        tiers = []
        for key in keys:
            tier = "host" if key in in_dram else self._local_tier(key)  # DRAM first, inline: hot
            if tier is None:
                break
            tiers.append(tier)
        if self.cluster is not None and len(tiers) < len(keys):
            tiers += self.cluster.lookup(keys[len(tiers) :], self._local_tier)
        return Lookup(len(tiers), tuple(tiers))

    def _local_tier(self, key: bytes) -> str | None:
        if self.host and key in self.host.table:
            return "host"
        if self.disk and (slot := self.disk.table.find(key)) is not None:
            return self.disk.kind_of(slot)
        return None

    def contains(self, key: bytes) -> bool:
        return self.lookup([key]).count == 1

    # -- reads ---------------------------------------------------------------------

    def buffers(self, count: int) -> list[memoryview]:
        """`count` chunk buffers a disk read lands in directly (no bounce copy): page
        aligned, huge pages where the kernel gives them. A buffer whose read missed its
        deadline is retired (a later get into it is refused): take a new one then."""
        buffer = AlignedBuffer(count * self.chunk_bytes)
        self._read_buffers.append(buffer)
        self.regions.add(buffer.address, buffer.nbytes, buffer)
        return [buffer.view[i * self.chunk_bytes : (i + 1) * self.chunk_bytes] for i in range(count)]

    def get_many(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[bool]:
        """Read chunks into caller buffers; result i tells whether out[i] holds chunk i.

        A False entry is a miss (absent, or did not verify): out[i] is then
        unspecified and the caller must recompute that chunk.
        """
        keys = self._keys(keys)
        views = self._views(outs, len(keys), writable=True)
        ok = [False] * len(keys)
        self._touch(keys)  # first: promoting this prompt's chunks never evicts its own
        if self.host is not None:
            with self.host.table.pinned(keys) as pins:
                self._read_host(keys, views, pins.hits, ok)
                for i, slot in pins.hits:
                    if not ok[i]:
                        pins.drop(keys[i], slot)
        if self.disk is not None and self._reader is not None:
            missing = [i for i, served in enumerate(ok) if not served]
            with self.disk.table.pinned(keys, missing) as pins:
                self._reader.read(keys, pins, views, self.policy.promote_on_hit, ok)
        if self.cluster is not None:
            self.cluster.read(keys, [i for i, served in enumerate(ok) if not served], views,
                              self.policy.promote_on_hit, ok)
        self._touch(keys)  # again: promoted chunks join their chain tail-older-than-head
        self.policy.seen([key for key, served in zip(keys, ok, strict=True) if served])
        self.stats.add("get.chunks", len(keys))
        self.stats.add("get.hits", sum(ok))
        return ok

    def _read_host(self, keys: Sequence[bytes], views: list[memoryview],
                   hits: list[tuple[int, int]], ok: list[bool]) -> None:
        assert self.host is not None
        copies = []
        for i, slot in hits:
            payload = self.host.payload(slot, keys[i], len(views[i]))
            if payload is None:
                self.stats.miss("host", MissReason.WRONG_KEY, f"slot {slot}")
                continue
            copies.append((views[i], payload))
            ok[i] = True
        if copies:
            started = time.perf_counter()
            copy_many(copies)  # the slots stay pinned until it returns
            # per chunk, as for disk reads: its time from the start of its batch
            self.stats.observe("host.read", time.perf_counter() - started, len(copies))
        served = [keys[i] for i, _ in hits if ok[i]]
        self._ledger.read(served)
        self.stats.add("host.hits", len(served))
        self.stats.add("host.bytes_read", len(served) * self.chunk_bytes)

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Promote the leading run of `keys` that is on disk into DRAM, ahead of the get
        that will want it (a request waiting to be scheduled); chunks already in DRAM
        are touched so eviction keeps them. Returns chunks promoted."""
        keys = self._keys(keys)
        if self.host is None or (self._reader is None and self.cluster is None):
            return 0
        self.host.table.touch_chain(keys)
        wanted = []
        for i, key in enumerate(keys):
            if key in self.host.table:
                continue
            if self.disk is None or key not in self.disk.table:
                if self.cluster is None:
                    break
                continue  # a peer's, read below
            wanted.append(i)
        ok = [False] * len(keys)
        wave = max(1, self.config.prefetch_inflight // self.slot_bytes)  # the cap on bytes in flight
        if self.disk is not None and self._reader is not None:
            with self.disk.table.pinned(keys, wanted) as pins:
                self._reader.read(keys, pins, None, promote=True, ok=ok, wave_chunks=wave)
        if self.cluster is not None:  # what no local tier holds, from peers
            self.cluster.read(keys, [i for i, key in enumerate(keys) if self._local_tier(key) is None],
                              None, True, ok)
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
        keys = self._keys(keys)
        if parent is not None:
            self._keys([parent])
        views = self._views(payloads, len(keys), writable=False)
        parents = [parent, *keys[:-1]]
        stored = [False] * len(keys)
        to_host: list[tuple[int, Reservation]] = []
        to_disk: list[int] = []
        self.policy.seen(keys)
        self._touch(keys)  # first: storing this prompt's chunks never evicts its own
        with ExitStack() as stack:
            for i, key in enumerate(keys):
                if (self.host and key in self.host.table) or (self.disk and key in self.disk.table):
                    stored[i] = True
                elif to_disk or (reservation := self._reserve_host()) is None:
                    to_disk.append(i)  # once DRAM refuses one (all pinned), it refuses the rest
                else:
                    stack.enter_context(reservation)  # released if anything below fails
                    to_host.append((i, reservation))
            demoting = [(i, r) for i, r in to_host if r.victim is not None]
            if demoting:
                usable = self._take_over([r for _, r in demoting])
                lost = {i for (i, _), ok in zip(demoting, usable, strict=True) if not ok}
                to_host = [(i, r) for i, r in to_host if i not in lost]
                to_disk = sorted(to_disk + list(lost))
            seq = next(self._seq)
            for i, reservation in to_host:
                assert self.host is not None
                self.host.write(reservation.slot, self.encoder.header(keys[i], parents[i], seq, views[i]),
                                views[i])
            if to_host:
                assert self.host is not None
                with self.host.table.lock:
                    for i, reservation in to_host:
                        reservation.publish(keys[i], parents[i], seq)
                        if self.policy.write_through and self._flusher is not None:
                            self._flusher.write_through(keys[i], reservation.slot)
                        stored[i] = True
                self.stats.add("host.bytes_written", len(to_host) * self.chunk_bytes)
        self._touch(keys)  # again: new chunks join their chain tail-older-than-head
        if to_disk and self._flusher is not None:
            admitted = [i for i in to_disk if self.policy.admits(keys[i])]
            self.stats.add("disk.not_admitted", len(to_disk) - len(admitted))
            headers = [self.encoder.header(keys[i], parents[i], seq, views[i]) for i in admitted]
            for i, done in zip(admitted, self._flusher.put_direct(headers, [views[i] for i in admitted]),
                               strict=True):
                stored[i] = done
        elif to_disk:
            self.stats.add("put.dropped", len(to_disk))
        return stored

    def _touch(self, keys: list[bytes]) -> None:
        for tier in (self.host, self.disk):
            if tier is not None:
                tier.table.touch_chain(keys)

    def _reserve_host(self, may_demote: bool = True) -> Reservation | None:
        """A DRAM slot for a new record. With a disk tier, a victim not on disk yet either
        comes with the reservation, to be written down first (`_take_over`), or, when
        `may_demote` is False, is passed over."""
        if self.host is None:
            return None
        fate = None
        if self._flusher is not None:
            fate = self._flusher.put_fate if may_demote else self._flusher.clean_fate
        reservation = self.host.table.reserve(fate=fate)
        if reservation is not None and reservation.evicted is not None:
            self._left_dram(reservation.evicted)
        return reservation

    def _take_over(self, reservations: list[Reservation]) -> list[bool]:
        """Write DEMOTE reservations' victims down, then their slots are ours."""
        assert self._flusher is not None
        usable = self._flusher.take_over(reservations)
        for reservation, ok in zip(reservations, usable, strict=True):
            if ok and reservation.evicted is not None:
                self._left_dram(reservation.evicted)
        return usable

    def _left_dram(self, key: bytes) -> None:
        self.stats.add("host.evictions")
        self._ledger.left_dram(key)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove chunks from every tier (on disk too, so a restart does not revive them).
        A disk record whose header cannot be zeroed stays (and is still served): what is
        indexed is what a restart would find. Returns the records removed."""
        removed = 0
        for key in self._keys(keys):
            if self.host is not None and self.host.table.unpublish(key) is not None:
                removed += 1
            if self.disk is None:
                continue
            with self.disk.table.pinned([key]) as pins:
                for _, slot in pins.hits:
                    if self.disk.zero_headers([slot], self.config.io.timeout_s)[0]:
                        pins.drop(key, slot)
                        removed += 1
                    else:
                        self.stats.add("disk.delete_failed")
                        log.warning("delete: could not zero the header of %s; the record stays",
                                    self.disk.describe(slot))
        return removed

    # -- housekeeping ----------------------------------------------------------------

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait for queued demotions to reach disk."""
        return self._flusher.flush(timeout_s) if self._flusher else True

    def info(self) -> dict[str, Any]:
        tiers = []
        if self.host:
            tiers.append({"name": "host", "chunks": len(self.host.table),
                          "capacity_bytes": self.host.table.capacity * self.slot_bytes,
                          "used_bytes": len(self.host.table) * self.slot_bytes})
        if self.disk:
            health = self.disk.availability.health
            tiers.append({"name": "disk", "chunks": len(self.disk.table),
                          "capacity_bytes": self.disk.capacity_bytes(),
                          "used_bytes": self.disk.used_bytes(),
                          "paths": [d.path for d in self.disk.devices.devices],
                          "devices": [{"path": d.path, **h.describe()} for d, h in
                                      zip(self.disk.devices.devices, health, strict=True)]})
        info = {"chunk_bytes": self.chunk_bytes, "slot_bytes": self.slot_bytes,
                "io_engine": self.engine.name, "tiers": tiers, "counters": self.stats.snapshot(),
                "recovery": self.recovery.as_dict()}
        if self.cluster is not None:
            info["cluster"] = self.cluster.info()
        return info

    def close(self) -> None:
        """Drain write-behind, write DRAM-only chunks down, checkpoint, release everything.

        DRAM does not survive the process; the disk does. Writing DRAM's chunks down
        on a clean shutdown means a restarted service still serves them.
        """
        self._close_cluster(withdraw=True)
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
        if self._flusher is not None:
            if not self._flusher.close(self.config.io.timeout_s):
                log.warning("close: write-behind did not drain in time; queued chunks dropped")
            self._flusher.demote_all()
            self._flusher = None
        if self.disk is not None:
            checkpoint(self.disk)
        self._close_parts()

    def simulate_crash(self) -> None:
        """Stop the way kill -9 would, for tests of recovery: nothing drained, written
        down or checkpointed (the superblocks stay dirty, the cluster lease runs out); only
        descriptors and memory are released."""
        self._close_cluster(withdraw=False)
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
        if self._flusher is not None:
            self._flusher.close(0)
            self._flusher = None
        self._close_parts()

    def _close_cluster(self, withdraw: bool) -> None:
        if self.cluster is not None:
            self.cluster.close(withdraw)
            self.cluster = None

    def _close_parts(self) -> None:
        self._close_cluster(withdraw=True)
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        if self.host is not None:
            self.host.close()
            self.host = None
        if self._owns_engine:
            self.engine.close()
        self._staging.close()
        self._headers.close()
        for buffer in self._read_buffers:
            buffer.close()
        self._read_buffers.clear()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the API edge ----------------------------------------------------------------

    @staticmethod
    def _keys(keys: Sequence[bytes]) -> list[bytes]:
        keys = list(keys)
        if set(map(type, keys)) <= {bytes} and set(map(len, keys)) <= {KEY_BYTES}:
            return keys  # the common case, checked at C speed: a lookup is on every request
        for i, key in enumerate(keys):
            if not isinstance(key, bytes) or len(key) != KEY_BYTES:
                what = f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__
                raise BadKeyError(f"key {i} is {what}; chunk keys are {KEY_BYTES} bytes "
                                  "(kvstore.format.keys.chunk_keys)")
        return keys

    def _views(self, buffers: Sequence[Any], count: int, *, writable: bool) -> list[memoryview]:
        if len(buffers) != count:
            raise ShapeError(f"{count} keys but {len(buffers)} buffers")
        views = []
        for i, buffer in enumerate(buffers):
            try:
                view = byte_view(buffer)
            except (TypeError, ValueError) as exc:
                raise ShapeError(f"buffer {i}: {exc}") from None
            if len(view) != self.chunk_bytes:
                raise ShapeError(f"buffer {i} has {len(view)} bytes; this store's chunks are "
                                 f"{self.chunk_bytes} bytes")
            if writable and view.readonly:
                raise ShapeError(f"buffer {i} is read-only: a get writes the chunk into it")
            if writable and self.regions.retired(view):
                raise ShapeError(f"buffer {i} was retired after a read into it missed its "
                                 "deadline (the device may still write it): take new ones with "
                                 "TieredStore.buffers()")
            views.append(view)
        return views
