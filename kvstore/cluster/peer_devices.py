"""Peers' block-tier devices, opened read-only here: where a peer's slot lives, and
whether that device serves.

Device i of a peer is the i-th of its block tier as its config lists it (disk paths,
then NVMe-oF namespaces), which is how its index entries number devices. Each is opened
O_RDONLY | O_DIRECT and never locked: its owner holds the exclusive flock (and O_EXCL
on a block device), which a read-only open neither needs nor disturbs. Its superblock
gives the slot geometry and the device id an entry must name, so a reformatted or
swapped device never matches. A peer is trusted as the index is: its records are
served once they verify, like this host's own.

Health is the local tier's (device_health.py): faults count toward the breaker, and a
missed deadline takes the device out at once, so a dead peer device costs one
deadline, then misses without I/O. The monitor thread probes NVMe-oF namespaces,
re-reads the superblocks of devices in service (a peer may reformat one), and reopens
those out of service once their probe passes and the breaker's cooldown is over.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from kvstore.cluster.index import DEVICE_ID_BYTES, Location
from kvstore.config.store import ClusterConfig, IoConfig
from kvstore.devices.device import DATA_FILE, DevicePlan
from kvstore.devices.health import OFFLINE, TRIPPED, DeviceHealth, fault_reason, is_fault, probe
from kvstore.devices.layout import Superblock, read_superblocks
from kvstore.devices.nvmeof.plans import namespace_plans
from kvstore.format.errors import ConfigError, DeviceError
from kvstore.format.units import format_size
from kvstore.io.base import TIMED_OUT, IoEngine

log = logging.getLogger(__name__)


@dataclass
class PeerDevice:
    host: str
    index: int  # its position in the peer's block tier
    plan: DevicePlan
    health: DeviceHealth
    path: str | None = None  # what is open: the data file or the block device
    fd: int = -1
    sb: Superblock | None = None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PeerDevices:
    def __init__(self, config: ClusterConfig, own_paths: list[str], engine: IoEngine, slot_bytes: int,
                 io: IoConfig, *, start: bool = True) -> None:
        self.engine = engine
        self.slot_bytes = slot_bytes
        self.timeout_s = io.timeout_s
        self.breaker_threshold = io.breaker_threshold
        self.cooldown_s = io.breaker_cooldown_s
        self._lock = threading.Lock()
        self.devices: dict[tuple[str, int], PeerDevice] = {}
        own = {os.path.realpath(path) for path in own_paths}
        try:
            self._open_all(config, own)
        except BaseException:
            for device in self:
                device.close()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvstore-peer-health", daemon=True)
        if start:
            self._thread.start()

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
                label = f"{peer.host_id} {plan.label or plan.path}"
                device = PeerDevice(peer.host_id, j, plan, DeviceHealth(label, plan.kind))
                self.devices[(peer.host_id, j)] = device
                problem = self._open(device, plan.path)
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
        sb = device.sb
        if not device.health.in_service or sb is None:
            return "unreachable"
        if sb.device_id[:DEVICE_ID_BYTES] != location.device_id or location.slot >= sb.num_slots:
            return "device_changed"
        return device, sb.data_offset + location.slot * sb.slot_bytes

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

    # -- opening, checking -------------------------------------------------------------

    def _open(self, device: PeerDevice, path: str | None) -> str | None:
        """Open `path` read-only and read its superblock; None when it serves, else why not."""
        if path is None:
            return "not present"
        if os.path.isdir(path):
            path = os.path.join(path, DATA_FILE)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            return f"cannot open {path} read-only: {exc.strerror}"
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISBLK(mode)):
            os.close(fd)
            return f"{path} is not a regular file or a block device"
        sb, problem = self._superblock(fd, path)
        if problem is not None:
            os.close(fd)
            return f"{path}: {problem}"
        device.close()
        device.path, device.fd, device.sb = path, fd, sb
        return None

    def _superblock(self, fd: int, path: str) -> tuple[Superblock | None, str | None]:
        """The device's superblock (devices/layout.py `read_superblocks`, as this host reads
        its own), or why there is none usable."""
        try:
            copies = read_superblocks(self.engine, fd, path, self.timeout_s)
        except DeviceError as exc:
            return None, str(exc).removeprefix(f"{path}: ")
        sb = next((c for _, c in copies if c is not None), None)
        if sb is None:
            return None, "no kvstore superblock (not formatted yet, or damaged)"
        if sb.slot_bytes != self.slot_bytes:
            return None, (f"formatted for {format_size(sb.chunk_bytes)} chunks; this store's slots "
                          f"are {format_size(self.slot_bytes)}")
        return sb, None

    def _loop(self) -> None:
        while not self._stop.wait(min(self.cooldown_s, 1.0)):
            try:
                self.check_once()
            except Exception:  # a monitor that dies silently would leave devices out forever
                log.exception("cluster: peer device check failed; retrying next interval")

    def check_once(self) -> None:
        for device in self:
            found = probe(device.plan.probe)
            health = device.health
            if health.in_service:
                problem = found.why if not found.usable else None
                if problem is None and found.path not in (None, device.plan.path, device.path):
                    problem = f"moved to {found.path}"
                if problem is None:
                    sb, problem = self._superblock(device.fd, device.path or "")
                    if sb is not None:
                        device.sb = sb
                if problem is not None:
                    with self._lock:
                        health.take_out(OFFLINE, problem)
                    log.warning("cluster: peer device %s out of service: %s", health.label, problem)
                continue
            if not found.usable:
                health.reason = found.why
                continue
            if health.cooling_down(self.cooldown_s, time.monotonic()):
                continue
            problem = self._open(device, found.path or device.plan.path)
            with self._lock:
                if problem is None:
                    health.put_back()
                    log.warning("cluster: peer device %s readable", health.label)
                else:
                    health.reason = problem

    def describe(self) -> list[dict[str, object]]:
        return [{"host": d.host, "device": d.index, "path": d.path, **d.health.describe()} for d in self]

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.timeout_s * 2 + 1)
        for device in self:
            device.close()
