"""Counters every tier reports into; `snapshot` is what `stats()` and `kvstore info` show."""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque

from kvstore.record import MissReason

log = logging.getLogger("kvstore")
LATENCY_SAMPLES = 65536


class Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()
        self._logged: set[tuple[str, MissReason]] = set()
        self._latency: dict[str, deque[float]] = {}

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

    def observe(self, name: str, seconds: float) -> None:
        """Record a latency sample (the most recent LATENCY_SAMPLES are kept per name)."""
        with self._lock:
            samples = self._latency.get(name)
            if samples is None:
                samples = self._latency[name] = deque(maxlen=LATENCY_SAMPLES)
            samples.append(seconds)

    def latency_ms(self, name: str, quantiles: tuple[float, ...] = (0.5, 0.99)) -> list[float]:
        with self._lock:
            samples = sorted(self._latency.get(name, ()))
        if not samples:
            return [float("nan")] * len(quantiles)
        return [1000 * samples[min(len(samples) - 1, int(q * len(samples)))] for q in quantiles]

    def reset_latency(self) -> None:
        with self._lock:
            self._latency.clear()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)
