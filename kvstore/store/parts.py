"""The store's parts, built from a config in dependency order and released in reverse.

Order matters: the disk index is recovered before anything writes; the flusher exists
before the DRAM cleaner and placement (both write DRAM chunks down through it), and the
cleaner stops before it; placement before the landings (promotions reserve through it);
landings before the readers and the cluster node. Invariants: a failure half-way
releases what was built; `close` releases each part once, whatever was built.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvstore.config.store import StoreConfig
from kvstore.datapath.cleaner import DramCleaner, clean_depth
from kvstore.datapath.copies_in_flight import CopiesInFlight
from kvstore.datapath.flusher import Flusher
from kvstore.datapath.landing import Landings
from kvstore.datapath.placement import DramPlacement
from kvstore.datapath.prefetch_ledger import PrefetchLedger
from kvstore.datapath.reader import DiskReader
from kvstore.devices.device import DevicePlan
from kvstore.devices.nvmeof.plans import namespace_plans
from kvstore.devices.watch import DeviceWatch
from kvstore.format.record import HEADER_BLOCK, record_bytes
from kvstore.format.units import parse_write_budget
from kvstore.io import IoEngine, make_engine
from kvstore.io.memfd import SharedMemory
from kvstore.io.regions import DirectRegions
from kvstore.io.staging import StagingPool
from kvstore.tiers.admission import Tuning
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.dram import DramTier
from kvstore.tiers.policy import TierPolicy
from kvstore.tiers.recover import RecoveryReport, recover
from kvstore.tiers.slots import Change, Entry
from kvstore.tiers.stats import Stats

if TYPE_CHECKING:
    from kvstore.cluster.node import ClusterNode

log = logging.getLogger(__name__)
STAGING_BYTES = 256 << 20  # bound on staging memory one disk-read wave may use


class StoreParts:
    """Every part of one store, each built once from the config (None: not configured,
    or released by `close`). TieredStore holds one and sequences requests over it."""

    def __init__(self, config: StoreConfig, chunk_bytes: int, engine: IoEngine | None,
                 background: bool) -> None:
        io = config.io
        self.config = config
        self.stats = Stats()
        self.chunk_bytes = chunk_bytes
        self.slot_bytes = record_bytes(chunk_bytes)
        self.policy = TierPolicy(promote_on_hit=config.promote_on_hit,
                                 write_through=config.write_policy == "write_through",
                                 admission=config.disk_admission, disk_min_seen=config.disk_min_seen,
                                 tuning=Tuning(config.disk_admission_threshold, config.disk_admission_loss),
                                 eviction=config.eviction, chunk_tokens=config.chunk_tokens)
        self.regions = DirectRegions()
        self.ledger = PrefetchLedger(self.stats, chunk_bytes)
        self.owns_engine = engine is None
        self.engine = engine or make_engine(io.engine, io.queue_depth)
        self.dram: DramTier | None = None
        self.disk: DiskTier | None = None
        self.flusher: Flusher | None = None
        self.cleaner: DramCleaner | None = None  # writes DRAM's coldest chunks down ahead of puts
        self.reader: DiskReader | None = None
        self.monitor: DeviceWatch | None = None  # moves devices out of and back into service
        self.cluster: ClusterNode | None = None
        self.placement: DramPlacement | None = None
        self.peer_copies: set[bytes] = set()  # DRAM chunks whose disk copy is a peer's
        self.in_flight = CopiesInFlight()  # DRAM chunks being written down, which a delete waits for
        self.staging = StagingPool(self.slot_bytes, io.queue_depth)
        self.headers = StagingPool(HEADER_BLOCK, io.queue_depth)
        self.recovery = RecoveryReport()
        try:
            self._build(chunk_bytes, background)
        except BaseException:
            self.close(crash=True)  # nothing half-built is written down or checkpointed
            raise

    def _build(self, chunk_bytes: int, background: bool) -> None:
        config, io = self.config, self.config.io
        if config.dram is not None:
            self.dram = DramTier(config.dram.capacity, self.slot_bytes,
                                 shared=config.service.share_dram != "off")
            self.dram.table.set_eviction(self.policy.make_eviction())
        plans = [DevicePlan(d.path, d.capacity) for d in config.disk]
        if config.nvmeof is not None:
            plans += namespace_plans(config.nvmeof)
        if plans:
            self.disk = DiskTier(plans, self.slot_bytes, chunk_bytes, self.engine, stats=self.stats,
                                 timeout_s=io.timeout_s, breaker_threshold=io.breaker_threshold)
            self.recovery = recover(self.disk)
            self.disk.table.set_eviction(self.policy.make_eviction())
            for counter in ("disk.bytes_written", "disk.admitted", "disk.admission_refused",
                            "disk.budget_refused"):  # scraped from the start
                self.stats.add(counter, 0)
            self.flusher = Flusher(self.disk, self.dram, self.policy, self.staging,
                                   queue_chunks=config.write_behind_chunks, in_flight=self.in_flight,
                                   background=background, held_elsewhere=self.peer_copies.__contains__)
        dram_chunks = self.dram.table.capacity if self.dram is not None else 0
        self.policy.set_capacity(dram_chunks, dram_chunks + (self.disk.table.capacity if self.disk else 0))
        self.set_write_budget(config.disk_write_budget)
        if self.dram is not None and self.disk is not None:
            self.dram.table.subscribe(self._left_dram)
        if self.dram is not None and self.flusher is not None:
            depth = clean_depth(config, chunk_bytes, self.dram.table.capacity)
            if depth > 0 and background:  # with no background threads, a put writes its victims
                # A failed pass pauses no longer than a tripped device takes to come back.
                self.cleaner = DramCleaner(self.dram, self.flusher, self.stats, depth,
                                           min(io.timeout_s, io.breaker_cooldown_s))
        if self.dram is not None:
            self.placement = DramPlacement(self.dram, self.flusher, self.stats, self.ledger, self.cleaner)
        landings = Landings(self.placement, self.staging, self.headers, self.regions, self.ledger,
                            chunk_bytes, self.in_flight)
        if self.disk is not None:
            slab = self.dram.slab if self.dram is not None else None
            if isinstance(slab, SharedMemory) and slab.pages == "4k":
                log.warning("the shared DRAM tier is in 4 KiB pages (no vm.nr_hugepages reserved, "
                            "shmem_enabled 'never'): disk reads into it split at each device's "
                            "segment limit; reserve huge pages or set shmem_enabled to 'advise'")
            self.reader = DiskReader(self.disk, landings, timeout_s=io.timeout_s,
                                     staging_wave=max(1, STAGING_BYTES // self.slot_bytes))
            interval = min(io.breaker_cooldown_s, config.nvmeof.health_interval_s
                           if config.nvmeof else 1.0)
            self.monitor = DeviceWatch(self.disk.availability, interval, io.breaker_cooldown_s,
                                       self.disk.timeout_s * 3 + interval, name="kvstore-health",
                                       start=background)
        if config.cluster is not None:
            from kvstore.cluster.node import ClusterNode  # imports redis: only for a cluster

            self.cluster = ClusterNode(config, disk=self.disk, landings=landings, engine=self.engine,
                                       peer_copies=self.peer_copies, background=background)

    def _left_dram(self, change: Change, entry: Entry) -> None:
        """The DRAM table's event (after the fact): a chunk evicted from DRAM is told to the
        policy, with whether its disk copy (or a peer's) is there; one the disk refused is
        counted here, once, however many times a victim scan asked about it. One dropped for
        want of a device in service is counted apart and not told: admission did not refuse
        it, and what it learns of refused chunks' returns must not count an outage's. A
        chunk removed (deleted, dropped as bad, replaced) was not refused either: not told."""
        if change is Change.EVICTED:
            key = entry.key
            on_disk = (self.disk is not None and key in self.disk.table) or key in self.peer_copies
            if not on_disk and self.disk is not None and not self.disk.availability.any_in_service():
                self.stats.add("dram.dropped_no_device")
                return
            reason = self.policy.left_dram(key, on_disk)
            if reason is not None:
                self.stats.add("disk.admission_refused")
                if reason == "budget":
                    self.stats.add("disk.budget_refused")

    def set_write_budget(self, budget: int | str | None) -> None:
        """Cap the disk tier's writes (config `disk_write_budget`: bytes a day, or drive writes
        per day of its capacity); None lifts the cap. Without a disk tier there is nothing to cap."""
        per_day = None if budget is None or self.disk is None else parse_write_budget(
            budget, self.disk.capacity_bytes())
        self.policy.set_budget(per_day, self.slot_bytes)

    def touch(self, keys: list[bytes]) -> None:
        """Mark `keys` (one chain, head first) recently used in every local tier."""
        for tier in (self.dram, self.disk):
            if tier is not None:
                tier.table.touch_chain(keys)

    def local_tier(self, key: bytes) -> str | None:
        """Which local tier holds `key` ('dram', 'disk' or 'nvmeof'), DRAM first."""
        if self.dram and key in self.dram.table:
            return "dram"
        if self.disk and (slot := self.disk.table.find(key)) is not None:
            return self.disk.kind_of(slot)
        return None

    def reload_policy(self, live: Mapping[str, Any]) -> None:
        """Apply the live keys a config reload changed (config.store.LIVE_KEYS, the service's
        SIGHUP): disk admission (with `disk_min_seen` and its tuning), eviction and the write
        budget. No chunk a tier holds is dropped or rewritten; only later decisions change."""
        named = (("threshold", "disk_admission_threshold"), ("loss", "disk_admission_loss"))
        tuned = {name: live[key] for name, key in named if live.get(key) is not None}
        min_seen = live.get("disk_min_seen")
        if tuned or live.get("disk_admission") is not None or min_seen is not None:
            tuning = dataclasses.replace(self.policy.tuning, **tuned)
            self.policy.set_admission(live.get("disk_admission") or self.policy.admission, min_seen, tuning)
        if live.get("eviction") is not None:
            self.policy.set_eviction(live["eviction"])
            for tier in (self.dram, self.disk):
                if tier is not None:
                    tier.table.set_eviction(self.policy.make_eviction())
        if "disk_write_budget" in live:
            self.set_write_budget(live["disk_write_budget"])

    def info(self) -> dict[str, Any]:
        """What `kvstore info` prints of this store: its tiers, counters, recovery, policy."""
        info = {"chunk_bytes": self.chunk_bytes, "slot_bytes": self.slot_bytes, "io_engine": self.engine.name,
                "tiers": [tier.info() for tier in (self.dram, self.disk) if tier is not None],
                "counters": self.stats.snapshot(),
                "recovery": self.recovery.as_dict(), "admission": self.policy.describe()}
        if self.cluster is not None:
            info["cluster"] = self.cluster.info()
        return info

    def close(self, crash: bool = False) -> None:
        """Release every part. Clean (`crash` False): write-through drained, DRAM-only chunks
        written down, the disk index checkpointed, the cluster lease withdrawn. A crash, as
        kill -9 would: none of that, only descriptors and memory released."""
        if self.cluster is not None:
            self.cluster.close(withdraw=not crash)
            self.cluster = None
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
        if self.cleaner is not None:
            assert self.flusher is not None
            if not self.cleaner.close(self.flusher.longest_write_down_s):  # its write lands first
                log.error("close: the DRAM cleaner's write did not end in its deadlines; the "
                          "disk tier is left open under it")
                self.flusher = self.disk = None  # never closed under a write in flight
            self.cleaner = None
        if self.flusher is not None:
            if not self.flusher.close(0 if crash else self.config.io.timeout_s) and not crash:
                log.warning("close: write-through queue did not drain in time; queued copies dropped")
            if not crash:
                self.flusher.demote_all()
            self.flusher = None
        if self.disk is not None:
            if not crash:
                self.disk.checkpoint()
            self.disk.close()
            self.disk = None
        if self.dram is not None:
            self.dram.close()
            self.dram = None
        if self.owns_engine:
            self.engine.close()
            self.owns_engine = False
        self.staging.close()
        self.headers.close()
