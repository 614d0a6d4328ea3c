"""Counters every tier reports into; `snapshot` is what `stats()` and `kvstore info` show."""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
from collections import defaultdict, deque

from kvstore.format.record import MissReason

log = logging.getLogger("kvstore")
LATENCY_SAMPLES = 65536
# Upper bounds (seconds) of the cumulative latency histograms Prometheus scrapes.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0)


class Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, float] = defaultdict(int)  # clients may add fractions (ms)
        self._logged: set[tuple[str, MissReason]] = set()
        self._latency: dict[str, deque[float]] = {}
        # name -> (count per bucket, +Inf last; sum of seconds): totals since start
        self._histograms: dict[str, tuple[list[int], list[float]]] = {}

    def add(self, name: str, amount: float = 1) -> None:
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

    def observe(self, name: str, seconds: float, times: int = 1) -> None:
        """Record a latency sample (`times` alike: chunks served by one batch): the most
        recent LATENCY_SAMPLES are kept per name (for quantiles), and every sample counts
        in the name's histogram."""
        with self._lock:
            samples = self._latency.get(name)
            if samples is None:
                samples = self._latency[name] = deque(maxlen=LATENCY_SAMPLES)
                self._histograms[name] = ([0] * (len(LATENCY_BUCKETS) + 1), [0.0])
            samples.extend([seconds] * min(times, LATENCY_SAMPLES))
            counts, total = self._histograms[name]
            counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += times
            total[0] += seconds * times

    def histogram(self, name: str) -> tuple[list[tuple[str, int]], float]:
        """Cumulative (upper bound, count) pairs ending with +Inf, and the sum of seconds."""
        with self._lock:
            counts, total = self._histograms.get(name, ([0] * (len(LATENCY_BUCKETS) + 1), [0.0]))
            counts = list(counts)
            seconds = total[0]
        bounds = [f"{b:g}" for b in LATENCY_BUCKETS] + ["+Inf"]
        return list(zip(bounds, itertools.accumulate(counts), strict=True)), seconds

    def latency_ms(self, name: str, quantiles: tuple[float, ...] = (0.5, 0.99)) -> list[float]:
        with self._lock:
            samples = sorted(self._latency.get(name, ()))
        if not samples:
            return [float("nan")] * len(quantiles)
        return [1000 * samples[min(len(samples) - 1, int(q * len(samples)))] for q in quantiles]

    def reset_latency(self) -> None:
        with self._lock:
            self._latency.clear()

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counters)
