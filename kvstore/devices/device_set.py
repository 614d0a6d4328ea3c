"""The disk tier's devices, in config order: opened at start, located per slot, reopened.

A device absent at start-up (an NVMe-oF namespace not connected yet) keeps a place
and the slot count its capacity gives, so slot numbers never shift; it is opened
later where its probe finds it, and must then hold the same geometry.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

from kvstore.devices.device import Device, DevicePlan, open_device
from kvstore.devices.layout import DeviceLayout, geometry
from kvstore.format.errors import DeviceError
from kvstore.io.base import IoEngine

log = logging.getLogger(__name__)


class DeviceSet:
    def __init__(self, plans: Sequence[DevicePlan], engine: IoEngine, slot_bytes: int,
                 chunk_bytes: int, timeout_s: float) -> None:
        self.plans = list(plans)
        self.engine = engine
        self.slot_bytes = slot_bytes
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.devices: list[Device] = []
        self.layouts: list[DeviceLayout | None] = []  # None: not opened yet (absent at start)
        try:
            for plan in self.plans:
                if plan.path is None:
                    self.devices.append(Device(plan.label, -1, plan.capacity, True, 4096))
                    self.layouts.append(None)
                    continue
                self.devices.append(open_device(plan.path, plan.capacity))
                self.layouts.append(self._layout(self.devices[-1]))
        except BaseException:
            self.close()
            raise

    def __getitem__(self, group: int) -> Device:
        return self.devices[group]

    def __len__(self) -> int:
        return len(self.devices)

    def __iter__(self) -> Iterator[Device]:
        return iter(self.devices)

    def _layout(self, device: Device) -> DeviceLayout:
        return DeviceLayout.open(device, self.engine, self.slot_bytes, self.chunk_bytes, self.timeout_s)

    def group_sizes(self) -> list[int]:
        return [geometry(plan.capacity, self.slot_bytes)[0] if layout is None else layout.sb.num_slots
                for plan, layout in zip(self.plans, self.layouts, strict=True)]

    def locate(self, group: int, local: int) -> tuple[int, int]:
        """(fd, byte offset) of a slot of an opened device (others have no slot in use)."""
        layout = self.layouts[group]
        assert layout is not None
        return layout.device.fd, layout.slot_offset(local)

    def reopen(self, group: int, path: str | None, num_slots: int) -> tuple[str | None, bool]:
        """Open device `group` at `path` (where its probe found it; None: where it was) if
        it is not open there yet: one absent until now, or moved. (problem or None, reopened?)"""
        device, plan = self.devices[group], self.plans[group]
        if path is None or (path == device.path and device.fd >= 0):
            return (None, False) if device.fd >= 0 else ("not present", False)
        device.close()  # first: the old node may be the same device (it holds the flock)
        try:
            opened = open_device(path, plan.capacity)
        except DeviceError as exc:
            return str(exc), False
        try:
            layout = self._layout(opened)
            if layout.sb.num_slots != num_slots:
                raise DeviceError(path, f"holds {layout.sb.num_slots} slots, this tier expects "
                                        f"{num_slots}")
            layout.mark_dirty()  # it is about to be written: its checkpoint would go stale
        except DeviceError as exc:
            opened.close()
            return str(exc), False
        self.devices[group], self.layouts[group] = opened, layout
        log.warning("disk tier: %s opened at %s", plan.label or path, path)
        return None, True

    def close(self) -> None:
        for device in self.devices:
            device.close()
