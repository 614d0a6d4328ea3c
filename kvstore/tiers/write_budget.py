"""A cap on the bytes written to the disk tier, and the admission threshold that keeps
writes under it, the chunks least likely to come back refused first.

`disk_write_budget` is the most bytes the disk tier may be written in any 24 hours. Writes
draw on an allowance that accrues at 23/24 of the budget a day and holds at most an hour's
worth (1/24): so no 24 hours write more than the hour held plus 23/24 of a day's accrual,
the budget itself. The writer claims each batch (`claim`) before issuing it and gives back
what did not land (`refund`), so the cap holds however many writers run at once.

Running the allowance dry refuses whatever comes next; `threshold` keeps that rare by
refusing the least likely to return first. Chunks leaving DRAM that would need a write are
counted (`offered`) by their bucket's return rate (return_rates.py) in RATE_BINS bins,
decayed over HORIZON_S; the threshold is the lowest bin edge at which the offered chunks at
or above it would be written no faster than the target: twice the accrual with the
allowance full, the accrual at half, nothing when empty, so the allowance settles where
what is admitted is what accrues.

Invariants: the allowance is never below 0 or above an hour's worth; `room`, `left` and
`threshold` never change state. Not thread-safe: TierPolicy calls it under its lock.
"""

from __future__ import annotations

import math

DAY_S = 86400.0
HELD = 1 / 24  # of the budget: the most allowance held (an hour's accrual)
RATE_BINS = 50
HORIZON_S = 600.0  # offered chunks' weight halves about every 7 minutes


class WriteBudget:
    def __init__(self, bytes_per_day: int, write_bytes: int, now: float) -> None:
        """`write_bytes`: what one chunk's write costs (its record, on the store's disk)."""
        if bytes_per_day < 0 or write_bytes <= 0:
            raise ValueError(f"a write budget of {bytes_per_day} bytes a day, {write_bytes} a write")
        self.bytes_per_day = bytes_per_day
        self.write_bytes = write_bytes
        self.held_max = bytes_per_day * HELD
        self.accrual = bytes_per_day * (1 - HELD) / DAY_S  # bytes a second
        self._held = self.held_max
        self._at = now  # when `_held` was last brought up to date
        self.written = 0  # bytes claimed and not given back
        self._offered = [0.0] * RATE_BINS  # chunks offered, decayed to `_since`
        self._since = now
        self._start = now

    def left(self, now: float) -> float:
        """Bytes that may be written now."""
        return min(self.held_max, self._held + self.accrual * max(0.0, now - self._at))

    def room(self, now: float) -> bool:
        """Whether one more chunk may be written now."""
        return self.left(now) >= self.write_bytes

    def claim(self, chunks: int, now: float) -> int:
        """How many of `chunks` writes may be issued now; they are charged at once."""
        self._held, self._at = self.left(now), now
        granted = max(0, min(chunks, int(self._held // self.write_bytes)))
        self._held -= granted * self.write_bytes
        self.written += granted * self.write_bytes
        return granted

    def refund(self, chunks: int, now: float) -> None:
        """Claimed writes that did not land give their allowance back."""
        self._held, self._at = min(self.held_max, self.left(now) + chunks * self.write_bytes), now
        self.written -= chunks * self.write_bytes

    def carry(self, held: float, now: float) -> None:
        """Start from another budget's allowance left, if that is less (a budget changed
        while serving: the cap holds across the change)."""
        self._held, self._at = min(self.left(now), held), now

    def offered(self, rate: float, now: float) -> None:
        """A chunk whose bucket returns at `rate` left DRAM and would need a write."""
        decay = math.exp(-max(0.0, now - self._since) / HORIZON_S)
        self._offered = [n * decay for n in self._offered]
        self._since = now
        self._offered[min(RATE_BINS - 1, max(0, int(rate * RATE_BINS)))] += 1

    def threshold(self, now: float) -> float:
        """The lowest return rate admitted so that writes keep within the allowance."""
        span = HORIZON_S * -math.expm1(-max(1e-9, now - self._start) / HORIZON_S)  # seconds counted
        decay = math.exp(-max(0.0, now - self._since) / HORIZON_S)
        target = 2 * self.accrual * self.left(now) / max(1e-9, self.held_max)  # bytes a second
        fits = target * span / (decay * self.write_bytes)  # chunks the span could have written
        total = 0.0
        for edge in range(RATE_BINS - 1, -1, -1):
            total += self._offered[edge]
            if total > fits:
                return (edge + 1) / RATE_BINS
        return 0.0

    def describe(self, now: float) -> dict[str, float]:
        return {"budget_bytes_per_day": self.bytes_per_day, "budget_left_bytes": self.left(now),
                "budget_threshold": self.threshold(now), "budget_written_bytes": self.written}
