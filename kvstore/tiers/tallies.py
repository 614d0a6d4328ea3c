"""Returns over exposure, counted in tallies: what `learned` disk admission keeps per bucket,
per group of buckets, for everyone, and per rate a chunk was judged at (return_rates.py).

A chunk that leaves DRAM is a departure of each of its tallies; when it is named again, a
return of each. A departure that has not come back yet may still: counting it in full at
once would take every tally for one that never returns until its returns arrive (minutes,
when people come back to a conversation). So a departure counts in proportion to the time it
has been out, up to the ramp (the caller's, `ramp_s`), and in full once out a whole ramp or
once it came back (`settle`). `rate` draws a tally with little exposure toward a prior.

Invariants: exposure is never negative nor above the departures counted; only `depart`,
`settle`, `returned`, `halve` and `restore` change state. Not thread-safe (TierPolicy calls
it under its lock).
"""

from __future__ import annotations

from collections.abc import Iterable


class Tallies:
    def __init__(self, size: int) -> None:
        self.size = size
        self.returns = [0.0] * size
        self.settled = [0.0] * size  # departures counted in full
        self._ramping = [[0, 0.0] for _ in range(size)]  # departures within the ramp: count, sum of times

    def depart(self, tallies: Iterable[int], when: float) -> None:
        """A departure at `when`, within the ramp from now on."""
        for tally in tallies:
            ramping = self._ramping[tally]
            ramping[0] += 1
            ramping[1] += when

    def settle(self, tallies: Iterable[int], when: float) -> None:
        """The departure at `when` (within the ramp) counts in full from now on."""
        for tally in tallies:
            ramping = self._ramping[tally]
            ramping[0] -= 1
            ramping[1] -= when
            self.settled[tally] += 1

    def returned(self, tallies: Iterable[int]) -> None:
        for tally in tallies:
            self.returns[tally] += 1

    def exposure(self, tally: int, now: float, ramp_s: float) -> float:
        """Departures counted in full, and those within the ramp in proportion to their time
        out by `now` (at most in full, though not yet settled)."""
        count, times = self._ramping[tally]
        young = min(float(count), max(0.0, (count * now - times) / ramp_s))
        return self.settled[tally] + young

    def rate(self, tally: int, now: float, ramp_s: float, prior: float, weight: float) -> float:
        """Returns over exposure, drawn toward `prior` as if it had `weight` departures more."""
        return (self.returns[tally] + weight * prior) / (self.exposure(tally, now, ramp_s) + weight)

    def halve(self) -> None:
        """Older counts weigh half (a change of traffic is followed)."""
        self.returns = [n / 2 for n in self.returns]
        self.settled = [n / 2 for n in self.settled]

    def restore(self, returns: list[float], settled: list[float]) -> None:
        """Counts a `returns`/`settled` pair of this size stood at (checked by the caller)."""
        if len(returns) != self.size or len(settled) != self.size:
            raise ValueError(f"tallies of {len(returns)} and {len(settled)}, not {self.size}")
        self.returns, self.settled = list(returns), list(settled)
