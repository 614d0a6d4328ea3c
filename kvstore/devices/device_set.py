"""A block tier's devices, in config order: opened at start, located per slot, reopened.

A device absent at start-up (an NVMe-oF namespace not connected yet) keeps a place
and the slot count its capacity gives, so slot numbers never shift; it is opened
later where its probe finds it, and must then hold the same geometry.

The same set, `read_only`, is another host's block tier as this host reads it (the
cluster's peer devices): opened read-only and never locked, its superblocks read and
never written, and a device that cannot be opened at start keeps its place (layout
None, `problems` says why) instead of failing the start.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

from kvstore.devices.device import Device, DevicePlan, open_device, open_read_only
from kvstore.devices.layout import DeviceLayout, geometry
from kvstore.format.errors import DeviceError
from kvstore.io.base import IoEngine

log = logging.getLogger(__name__)


class DeviceSet:
    def __init__(self, plans: Sequence[DevicePlan], engine: IoEngine, slot_bytes: int,
                 chunk_bytes: int, timeout_s: float, *, read_only: bool = False) -> None:
        self.plans = list(plans)
        self.engine = engine
        self.slot_bytes = slot_bytes
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.read_only = read_only
        self.devices: list[Device] = []
        self.layouts: list[DeviceLayout | None] = []  # None: not opened yet (absent at start)
        self.problems: list[str | None] = []  # why a device is not open (None: it is)
        try:
            for plan in self.plans:
                self.devices.append(Device(plan.label or plan.path or "", -1, plan.capacity, True, 4096))
                self.layouts.append(None)
                self.problems.append("not present")
                if plan.path is None:
                    continue
                try:
                    self.devices[-1], self.layouts[-1] = self._open(plan, plan.path)
                except DeviceError as exc:
                    if not read_only:
                        raise
                    self.problems[-1] = str(exc)
                    continue
                self.problems[-1] = None
        except BaseException:
            self.close()
            raise

    def __getitem__(self, group: int) -> Device:
        return self.devices[group]

    def __len__(self) -> int:
        return len(self.devices)

    def __iter__(self) -> Iterator[Device]:
        return iter(self.devices)

    def _open(self, plan: DevicePlan, path: str) -> tuple[Device, DeviceLayout]:
        """The device at `path` and its layout (read-only: a view of the owner's)."""
        device = open_read_only(path) if self.read_only else open_device(path, plan.capacity)
        try:
            if self.read_only:
                return device, DeviceLayout.view(device, self.engine, self.slot_bytes, self.timeout_s)
            return device, DeviceLayout.open(device, self.engine, self.slot_bytes, self.chunk_bytes,
                                             self.timeout_s)
        except BaseException:
            device.close()
            raise

    def group_sizes(self) -> list[int]:
        return [geometry(plan.capacity, self.slot_bytes)[0] if layout is None else layout.sb.num_slots
                for plan, layout in zip(self.plans, self.layouts, strict=True)]

    def locate(self, group: int, local: int) -> tuple[int, int]:
        """(fd, byte offset) of a slot of an opened device (others have no slot in use)."""
        layout = self.layouts[group]
        assert layout is not None
        return layout.device.fd, layout.slot_offset(local)

    def reopen(self, group: int, path: str | None, num_slots: int | None = None) -> tuple[str | None, bool]:
        """Open device `group` at `path` (where its probe found it; None: where it was) if
        it is not open there yet: one absent until now, or moved; read-only, always (a view
        is cheap to open, and its owner may have replaced the device). It must hold
        `num_slots` when given. (problem or None, reopened?)"""
        device, plan = self.devices[group], self.plans[group]
        if self.read_only:
            path = path or (device.path if device.fd >= 0 else plan.path)
        elif path is None or (path == device.path and device.fd >= 0):
            return (None, False) if device.fd >= 0 else ("not present", False)
        if path is None:
            return "not present", False
        device.close()  # first: the old node may be the same device (it holds the flock)
        try:
            opened, layout = self._open(plan, path)
        except DeviceError as exc:
            self.problems[group] = str(exc)
            return str(exc), False
        try:
            if num_slots is not None and layout.sb.num_slots != num_slots:
                raise DeviceError(path, f"holds {layout.sb.num_slots} slots, this tier expects "
                                        f"{num_slots}")
            if not self.read_only:
                layout.mark_dirty()  # it is about to be written: its checkpoint would go stale
        except DeviceError as exc:
            opened.close()
            self.problems[group] = str(exc)
            return str(exc), False
        self.devices[group], self.layouts[group], self.problems[group] = opened, layout, None
        if not self.read_only:
            log.warning("disk tier: %s opened at %s", plan.label or path, path)
        return None, True

    def close(self) -> None:
        for device in self.devices:
            device.close()
