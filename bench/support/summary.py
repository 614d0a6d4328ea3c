"""Summaries of per-request timings shared by the TTFT benchmarks."""

from __future__ import annotations

import statistics
from collections.abc import Iterable


def p50_p90(values: Iterable[float]) -> tuple[float, float]:
    """Median and 90th percentile (nearest rank) of a few samples."""
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
