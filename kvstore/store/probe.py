"""A read-only view of where a store's chunks are: for tests, `kvstore info` and tools that
must see the tiers without holding them.

It answers from the tiers' tables (a snapshot: a chunk may move the moment after) and
changes nothing: no touch, no counter, no pin but the moment a header scan
(`namespaces`) reads a batch's headers. Code outside `kvstore/store/` reads a
store's state here, never through `TieredStore.parts` (tests/house_rules.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvstore.store.purge import held

if TYPE_CHECKING:
    from kvstore.store.parts import StoreParts

Tier = Literal["dram", "disk"]


@dataclass(frozen=True)
class Place:
    """Where one chunk is in this host's tiers. `device` and `offset`: the file holding its
    disk record and the record's first byte there (None when not on disk)."""

    in_dram: bool
    on_disk: bool
    device: str | None = None
    offset: int | None = None


@dataclass(frozen=True)
class DeviceState:
    """One device of the disk tier: its path, where its first slot starts (None: not open,
    absent at start), its health state (devices/health.py: in service, tripped...), why
    it is out of service ("" when in), how often its breaker tripped, and whether it is a
    block device of 4096-byte logical blocks or a file."""

    path: str
    data_offset: int | None
    state: str
    reason: str = ""
    trips: int = 0
    block: bool = False


class StoreProbe:
    """Where a store's chunks are, for code that must see the tiers without holding them
    (`TieredStore.probe`): it exists so that nothing outside kvstore/store/ reads the
    store's parts. Invariant: it changes nothing (no touch, counter or lasting pin), and
    each answer is a snapshot of the tiers' tables."""

    def __init__(self, parts: StoreParts) -> None:
        self._parts = parts

    def where(self, key: bytes) -> Place:
        dram, disk = self._parts.dram, self._parts.disk
        in_dram = dram is not None and key in dram.table
        slot = disk.table.find(key) if disk is not None else None
        if disk is None or slot is None:
            return Place(in_dram, False)
        _fd, offset = disk.locate(slot)
        return Place(in_dram, True, disk.devices[disk.table.groups.of(slot)[0]].path, offset)

    def keys(self, tier: Tier) -> set[bytes]:
        """The keys a tier publishes now ('dram': DRAM; 'disk': every device), empty without it."""
        part = self._parts.dram if tier == "dram" else self._parts.disk
        return {entry.key for entry in part.table.entries()} if part is not None else set()

    def namespaces(self) -> set[bytes] | None:
        """The namespace digests this host's records name (their headers: DRAM's read in
        place, the disk's one 4 KiB read each, as a purge reads them), or None when a disk
        header could not be read."""
        return held(self._parts)

    def pinned(self) -> int:
        """DRAM slots pinned now (reads, leases, reservations, and I/O not landed yet)."""
        dram = self._parts.dram
        if dram is None:
            return 0
        with dram.table.lock:
            return sum(info.pins > 0 for info in dram.table.slots)

    def capacity(self, tier: Tier) -> int:
        """Chunks the tier holds at most (0 without it)."""
        part = self._parts.dram if tier == "dram" else self._parts.disk
        return part.table.capacity if part is not None else 0

    def devices(self) -> list[DeviceState]:
        """The disk tier's devices in group order (empty without one)."""
        disk = self._parts.disk
        if disk is None:
            return []
        return [DeviceState(device.path, layout.sb.data_offset if layout is not None else None,
                            health.state, health.reason, health.trips,
                            device.is_block and device.logical_block == 4096 and device.fd >= 0)
                for device, layout, health in zip(disk.devices, disk.devices.layouts,
                                                  disk.availability.health, strict=True)]

    def at_peers(self, keys: list[bytes]) -> set[bytes]:
        """Those of `keys` the cluster index says a live peer holds (one index read, no
        answer cached); empty without a cluster."""
        cluster = self._parts.cluster
        return set(cluster.index.locate(keys) or {}) if cluster is not None else set()

    def recovery(self) -> dict[str, float]:
        """What recovery found at start (tiers/recover.py RecoveryReport), as `info` prints it."""
        return self._parts.recovery.as_dict()
