"""Per-device health: fault counting, the circuit breaker, and in/out of service.

A device that faults (EIO, ENOLINK, ENODEV, ENXIO, ETIMEDOUT, a missed deadline,
a short transfer) `threshold` times in a row is taken out of service: its chunks
become misses at once instead of each costing a deadline. A device is also taken
out when its probe (an NVMe-oF controller's state) says it is not usable. It comes
back only through revalidation (availability.py). Mutated under the disk tier's
table lock.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.io.base import TIMED_OUT

FAULT_ERRNOS = frozenset({errno.EIO, errno.ENOLINK, errno.ENODEV, errno.ENXIO, errno.ETIMEDOUT})
IN_SERVICE, TRIPPED, OFFLINE = "in_service", "tripped", "offline"


@dataclass(frozen=True)
class Presence:
    """What a probe found: usable now (for NVMe-oF: a controller of the namespace is
    live), why not, and the device path it is at now (None: unknown or absent)."""

    usable: bool
    why: str = ""
    path: str | None = None


Probe = Callable[[], Presence]


def probe(found: Probe | None) -> Presence:
    """Ask a device's probe (none: always usable); a probe that raises says "out"."""
    if found is None:
        return Presence(True)
    try:
        return found()
    except Exception as exc:  # a probe reads sysfs: treat its failure as "unknown, out"
        return Presence(False, f"probe failed: {exc}")


def fault_reason(result: int) -> str:
    """A faulted I/O result in words, for the log line that takes a device out."""
    if result == TIMED_OUT:
        return "deadline passed"
    return os.strerror(-result) if result < 0 else f"short transfer ({result} bytes)"


def is_fault(result: int, expected: int) -> bool:
    """A result that says the device (or the path to it) is failing, not the record."""
    if result == TIMED_OUT or (result < 0 and -result in FAULT_ERRNOS):
        return True
    return 0 <= result < expected


@dataclass
class DeviceHealth:
    label: str  # how an operator knows it: a path, or an NVMe-oF subsystem and namespace
    kind: str  # "disk" or "nvmeof"
    # Its state, kept by record() and take_out(), never given at the start:
    state: str = field(default=IN_SERVICE, init=False)
    reason: str = field(default="", init=False)
    consecutive_faults: int = field(default=0, init=False)
    faults: int = field(default=0, init=False)
    trips: int = field(default=0, init=False)
    since: float = field(default_factory=time.monotonic, init=False)
    # Bumped each time the device leaves service: a write reserved in an older epoch
    # lands on a device that was declared lost, so it is never published.
    epoch: int = field(default=0, init=False)

    @property
    def in_service(self) -> bool:
        return self.state == IN_SERVICE

    def record(self, fault: bool, threshold: int) -> bool:
        """Count one result; True when this fault trips the breaker."""
        if not fault:
            self.consecutive_faults = 0
            return False
        self.faults += 1
        self.consecutive_faults += 1
        return self.in_service and self.consecutive_faults >= threshold

    def take_out(self, state: str, reason: str) -> None:
        self.state, self.reason = state, reason
        self.since = time.monotonic()
        self.epoch += 1
        if state == TRIPPED:
            self.trips += 1

    def cooling_down(self, cooldown_s: float, now: float) -> bool:
        """A tripped breaker waits `cooldown_s` from its last failure before a retry."""
        return self.state == TRIPPED and now - self.since < cooldown_s

    def put_back(self) -> None:
        self.state, self.reason = IN_SERVICE, ""
        self.consecutive_faults = 0
        self.since = time.monotonic()

    def describe(self) -> dict[str, object]:
        return {"label": self.label, "kind": self.kind, "state": self.state, "reason": self.reason,
                "faults": self.faults, "trips": self.trips}
