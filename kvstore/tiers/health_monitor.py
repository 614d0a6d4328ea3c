"""The thread that moves disk-tier devices out of and back into service.

Every `interval_s` it asks each device's probe (for NVMe-oF: is a controller of
the namespace live?). A device in service whose probe fails, or that now sits at
another device path, is taken out. A device out of service (including one absent
at start-up) is revalidated, and opened where it now is, once its probe passes
and, if its breaker tripped, once `cooldown_s` has passed since it last failed. All device I/O it
does has the tier's deadline, so a hung device cannot hang it for long.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstore.devices.health import OFFLINE, probe
from kvstore.tiers.disk import DiskTier

log = logging.getLogger(__name__)


class HealthMonitor:
    def __init__(self, disk: DiskTier, interval_s: float, cooldown_s: float, *,
                 start: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.disk = disk
        self.interval_s = interval_s
        self.cooldown_s = cooldown_s
        self.clock = clock  # a seam: tests move time on
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvstore-health", daemon=True)
        if start:  # tests drive check_once themselves
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check_once()
            except Exception:  # a monitor that dies silently would leave devices out forever
                log.exception("health monitor: check failed; retrying next interval")

    def check_once(self) -> None:
        availability, devices = self.disk.availability, self.disk.devices
        for group, (health, plan) in enumerate(zip(availability.health, devices.plans, strict=True)):
            found = probe(plan.probe)
            if health.in_service:
                moved = found.path not in (None, devices.devices[group].path)
                if not found.usable or moved:
                    availability.take_out(group, OFFLINE, found.why or f"moved to {found.path}")
                continue
            if not found.usable:
                health.reason = found.why
                continue
            if not health.cooling_down(self.cooldown_s, self.clock()):
                availability.revalidate(group, found.path)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.disk.timeout_s * 3 + self.interval_s)
