"""The thread that moves a block tier's devices out of and back into service.

One watch serves both block tiers this host reads: its own disk tier
(tiers/availability.py takes a device out and revalidates it) and each peer's, read
here (cluster/peer_devices.py). Every `interval_s` it asks each device's probe (for
NVMe-oF: is a controller of the namespace live?). A device in service whose probe
fails, that now sits at another device path, or that fails the tier's own check (a
peer's superblock re-read: a peer may reformat its device) is taken out. A device out of
service (including one absent at start-up) is brought back where its probe finds it,
once the probe passes and, if its breaker tripped, once `cooldown_s` has passed since it
last failed. The tier's own steps do all device I/O within its deadline, so a hung
device cannot hang the watch for long.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from kvstore.devices.health import OFFLINE, DeviceHealth, Probe, probe

log = logging.getLogger(__name__)


class Watched(Protocol):
    """A block tier as the watch sees it; device i is the tier's i-th, in config order."""

    def watched(self) -> Sequence[tuple[DeviceHealth, Probe | None, str | None]]:
        """Each device's health, its probe, and the path it is open at (None: not open)."""
        ...

    def recheck(self, i: int) -> str | None:
        """What is wrong with device i, in service, beyond its probe (None: nothing)."""
        ...

    def take_out(self, i: int, state: str, reason: str) -> None: ...

    def revalidate(self, i: int, path: str | None) -> bool:
        """Open device i at `path` if it is not open there, check it, serve it again:
        True when it serves. A failure leaves it out, with the reason in its health."""
        ...


class DeviceWatch:
    def __init__(self, tier: Watched, interval_s: float, cooldown_s: float, join_s: float, *,
                 name: str, start: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.tier = tier
        self.interval_s = interval_s
        self.cooldown_s = cooldown_s
        self.join_s = join_s  # the longest one device's step can take: the tier's deadlines, and an interval
        self.clock = clock  # a seam: tests move time on
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        if start:  # tests drive check_once themselves
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check_once()
            except Exception:  # a watch that dies silently would leave devices out forever
                log.exception("%s: device check failed; retrying next interval", self._thread.name)

    def check_once(self) -> None:
        for i, (health, device_probe, at) in enumerate(self.tier.watched()):
            if self._stop.is_set():  # closing: `join_s` waits out the device in hand, not the rest
                return
            found = probe(device_probe)
            if health.in_service:
                problem = (found.why or "not usable" if not found.usable
                           else f"moved to {found.path}" if found.path not in (None, at)
                           else self.tier.recheck(i))
                if problem is not None:
                    self.tier.take_out(i, OFFLINE, problem)
                continue
            if not found.usable:
                health.reason = found.why
                continue
            if not health.cooling_down(self.cooldown_s, self.clock()):
                self.tier.revalidate(i, found.path)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.join_s)
