"""Counters every tier reports into; `snapshot` is what `stats()` and `kvstore info` show."""

from __future__ import annotations

import logging
import threading
from collections import Counter

from kvstore.record import MissReason

log = logging.getLogger("kvstore")


class Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()
        self._logged: set[tuple[str, MissReason]] = set()

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counters[name] += amount

    def miss(self, tier: str, reason: MissReason, detail: str) -> None:
        """Count a chunk that looked present but was not served; log each kind once."""
        with self._lock:
            self._counters[f"{tier}.miss.{reason.value}"] += 1
            first = (tier, reason) not in self._logged
            self._logged.add((tier, reason))
        (log.warning if first else log.debug)("%s tier: not serving chunk (%s): %s",
                                              tier, reason.value, detail)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)
