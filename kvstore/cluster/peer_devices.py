"""Peers' block-tier devices, read here: where a peer's slot lives, and whether that
device serves.

Each peer's block tier is a read-only `DeviceSet` (devices/device_set.py): device i of a
peer is the i-th of its tier as its config lists it (disk paths, then NVMe-oF
namespaces), which is how its index entries number devices; opened O_RDONLY | O_DIRECT,
never locked, its superblock read (never written) as this host reads its own. The
superblock gives the slot geometry and the device id an entry must name, so a
reformatted or swapped device never matches. A peer is trusted as the index is: its
records are served once they verify, like this host's own.

Health is the local tier's (devices/health.py): faults count toward the breaker, and a
missed deadline takes the device out at once, so a dead peer device costs one
deadline, then misses without I/O. The device watch (devices/watch.py, the same thread
as this host's own disk tier has) probes NVMe-oF namespaces, re-reads the superblocks of
devices in service (a peer may reformat one), and reopens those out of service once
their probe passes and the breaker's cooldown is over.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from kvstore.cluster.index import DEVICE_ID_BYTES, Location
from kvstore.config.store import ClusterConfig, IoConfig
from kvstore.devices.device import DevicePlan
from kvstore.devices.device_set import DeviceSet
from kvstore.devices.health import OFFLINE, TRIPPED, DeviceHealth, Probe, fault_reason, is_fault
from kvstore.devices.nvmeof.plans import namespace_plans
from kvstore.devices.watch import DeviceWatch
from kvstore.format.errors import ConfigError, DeviceError
from kvstore.io.base import TIMED_OUT, IoEngine

log = logging.getLogger(__name__)


@dataclass
class PeerDevice:
    """One device of a peer's tier: its place in the peer's read-only DeviceSet, and its health."""

    host: str
    index: int  # its position in the peer's block tier
    tier: DeviceSet
    health: DeviceHealth

    @property
    def plan(self) -> DevicePlan:
        return self.tier.plans[self.index]

    @property
    def fd(self) -> int:
        return self.tier[self.index].fd

    @property
    def path(self) -> str | None:
        return self.tier[self.index].path if self.fd >= 0 else None


class PeerDevices:
    def __init__(self, config: ClusterConfig, own_paths: list[str], engine: IoEngine, slot_bytes: int,
                 io: IoConfig, *, start: bool = True) -> None:
        self.engine = engine
        self.slot_bytes = slot_bytes
        self.timeout_s = io.timeout_s
        self.breaker_threshold = io.breaker_threshold
        self.cooldown_s = io.breaker_cooldown_s
        self._lock = threading.Lock()
        self.tiers: list[DeviceSet] = []
        self.devices: dict[tuple[str, int], PeerDevice] = {}
        own = {os.path.realpath(path) for path in own_paths}
        try:
            self._open_all(config, own)
            self._listed = list(self.devices.values())  # the watch's numbering
            interval = min(self.cooldown_s, 1.0)
            self._watch = DeviceWatch(self, interval, self.cooldown_s, self.timeout_s * 3 + interval,
                                      name="kvstore-peer-health", start=start)
        except BaseException:
            self._close_tiers()
            raise

    def _open_all(self, config: ClusterConfig, own: set[str]) -> None:
        for i, peer in enumerate(config.peers):
            plans = [DevicePlan(d.path, d.capacity) for d in peer.disk]
            if peer.nvmeof is not None:
                try:
                    plans += namespace_plans(peer.nvmeof)
                except DeviceError as exc:
                    raise ConfigError(f"cluster.peers[{i}].nvmeof", exc.path, str(exc)) from None
            for j, plan in enumerate(plans):
                if plan.path is not None and os.path.realpath(plan.path) in own:
                    field = (f"disk[{j}].path" if j < len(peer.disk)
                             else f"nvmeof.namespaces[{j - len(peer.disk)}]")
                    raise ConfigError(f"cluster.peers[{i}].{field}", plan.label or plan.path,
                                      "is one of this host's own devices")
            tier = DeviceSet(plans, self.engine, self.slot_bytes, 0, self.timeout_s, read_only=True)
            self.tiers.append(tier)
            for j, plan in enumerate(plans):
                label = f"{peer.host_id} {plan.label or plan.path}"
                device = PeerDevice(peer.host_id, j, tier, DeviceHealth(label, plan.kind))
                self.devices[(peer.host_id, j)] = device
                problem = tier.problems[j]
                if problem is not None:
                    device.health.take_out(OFFLINE, problem)
                    log.warning("cluster: peer device %s not readable yet (%s); retried in the "
                                "background", label, problem)

    def __iter__(self) -> Iterator[PeerDevice]:
        return iter(self.devices.values())

    # -- the read path ---------------------------------------------------------------

    def locate(self, host: str, location: Location) -> tuple[PeerDevice, int] | str:
        """(device, byte offset) of an index entry's slot, or why it cannot be read."""
        device = self.devices.get((host, location.device))
        if device is None:
            return "unlisted"  # a device this host's config does not list for that peer
        layout = device.tier.layouts[device.index]
        if not device.health.in_service or layout is None:
            return "unreachable"
        sb = layout.sb
        if sb.device_id[:DEVICE_ID_BYTES] != location.device_id or location.slot >= sb.num_slots:
            return "device_changed"
        return device, layout.slot_offset(location.slot)

    def account(self, device: PeerDevice, result: int, expected: int) -> None:
        """Feed one read's result to the device's breaker; a missed deadline trips it."""
        with self._lock:
            health = device.health
            tripped = health.record(is_fault(result, expected), self.breaker_threshold)
            if health.in_service and (tripped or result == TIMED_OUT):
                why = fault_reason(result)
                health.take_out(TRIPPED, why)
                log.warning("cluster: peer device %s taken out of service (%s); its chunks are "
                            "misses until it revalidates", health.label, why)

    # -- as the device watch sees the peers' devices (devices/watch.py) ---------------

    def watched(self) -> list[tuple[DeviceHealth, Probe | None, str | None]]:
        return [(d.health, d.plan.probe, d.path) for d in self._listed]

    def recheck(self, i: int) -> str | None:
        """A peer may reformat a device it owns: its superblock is read again."""
        device = self._listed[i]
        layout = device.tier.layouts[device.index]
        try:
            if layout is not None:
                layout.reread()
        except DeviceError as exc:
            return str(exc)
        return None

    def take_out(self, i: int, state: str, reason: str) -> None:
        health = self._listed[i].health
        with self._lock:
            health.take_out(state, reason)
        log.warning("cluster: peer device %s out of service: %s", health.label, reason)

    def revalidate(self, i: int, path: str | None) -> bool:
        """Open the device again (where its probe found it) and read its superblock."""
        device = self._listed[i]
        problem, _ = device.tier.reopen(device.index, path)
        with self._lock:
            if problem is None:
                device.health.put_back()
                log.warning("cluster: peer device %s readable", device.health.label)
            else:
                device.health.reason = problem
        return problem is None

    def check_once(self) -> None:
        """What the watch thread does once (tests and a store without threads call it)."""
        self._watch.check_once()

    def describe(self) -> list[dict[str, object]]:
        return [{"host": d.host, "device": d.index, "path": d.path, **d.health.describe()} for d in self]

    def close(self) -> None:
        self._watch.close()
        self._close_tiers()

    def _close_tiers(self) -> None:
        for tier in self.tiers:
            tier.close()
