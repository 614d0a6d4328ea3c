"""The threshold `learned` disk admission asks of a chunk's return rate, tuned to a loss
budget: the share of the store's hits admission may give up (`disk_admission_loss`).

What it weighs, each a flow decayed over HORIZON_S (recent traffic weighs most):
- hits: chunks requests read from the store (`served`);
- lost: the hits refusals cost, measured (`lost`, from return_rates.named): a chunk that
  left DRAM without a disk copy and was named again, and every departed chunk named after
  it in its chain, whose prefix broke there. The departures of refused chunks are
  remembered like any other (ghost entries, no bytes), so their returns are seen;
  `refused_back` of the lost are the refused chunks themselves;
- offered: chunks that left DRAM needing a disk write, by the rate they were judged at
  (`offered`).

The threshold is the highest judged-rate bin edge t such that refusing what is offered
below t would lose no more than may be spent (feedforward): the loss expected of a bin is
what it is offered times its rate, times how often refused chunks came back for what their
rates said (ReturnRates.refusals: measured where the rates refuse), times the hits a
refused chunk that came back cost (lost over refused_back: a broken prefix loses the hits
after it too). What may be spent
is the budget times the hits, scaled by how the measured loss stands against it
(feedback): (budget x hits + SMOOTHING) / (lost + SMOOTHING), within FEEDBACK, so a
measured loss over the budget lowers the threshold and one under it lets it rise, whatever
the rates' errors. A bin is refused only once the departures judged below the threshold
have together been watched as long as the prior weighs (ReturnRates.judged, .weight):
nothing is refused before returns could have been seen, so from cold the threshold is 0 and
every chunk is written, as under `all`. A budget of 0 keeps it at 0.

Invariants: the threshold is a bin edge from 0 to 1; only `served`, `lost` and `offered`
change state (`offered` recomputes the threshold every REFRESH departures). Not
thread-safe: TierPolicy calls it under its lock.
"""

from __future__ import annotations

import math

from kvstore.tiers.return_rates import RATE_BINS, ReturnRates, bin_edge, judged_bin

LOSS = 0.01  # the share of hits `learned` admission may give up by default
HORIZON_S = 600.0  # the flows' weight falls by e about every 10 minutes
SMOOTHING = 5.0  # hits lost: what a ratio of few counts leans on
FEEDBACK = (0.1, 2.0)  # the least and most the budget is scaled by the measured loss
REFRESH = 16  # departures between two computations of the threshold
_RESCALE = 30.0  # horizons between rescalings of the flows' weights (e^30: far from overflow)


class LossBudget:
    def __init__(self, loss: float = LOSS) -> None:
        if not 0.0 <= loss <= 1.0:
            raise ValueError(f"a loss budget of {loss}: a share of hits from 0 to 1")
        self.loss = loss
        self.threshold = 0.0
        self._origin: float | None = None  # when a flow's newest count weighs 1
        self._hits = self._lost = self._refused_back = 0.0  # weighted: see `_weight`
        self._offered = [0.0] * RATE_BINS
        self._departures = 0

    def _weight(self, now: float) -> float:
        """A count made now weighs e^((now - origin) / HORIZON_S): older ones weigh less
        against it, with no pass over every flow at each count (rescaled now and then)."""
        if self._origin is None:
            self._origin = now
        exponent = (now - self._origin) / HORIZON_S
        if exponent > _RESCALE:
            fall = math.exp(-exponent)
            self._hits, self._lost, self._refused_back = (
                n * fall for n in (self._hits, self._lost, self._refused_back))
            self._offered = [n * fall for n in self._offered]
            self._origin, exponent = now, 0.0
        return math.exp(max(exponent, 0.0))

    def served(self, chunks: int, now: float) -> None:
        """Requests read these many chunks from the store."""
        self._hits += chunks * self._weight(now)

    def lost(self, lost: int, refused_back: int, now: float) -> None:
        """Refusals cost these many hits, `refused_back` of them refused chunks named again."""
        weight = self._weight(now)
        self._lost += lost * weight
        self._refused_back += refused_back * weight

    def measured(self) -> float:
        """The share of hits refusals cost lately."""
        return self._lost / (self._hits + self._lost) if self._hits + self._lost else 0.0

    def offered(self, judged: float, now: float, rates: ReturnRates) -> None:
        """A chunk judged at return rate `judged` left DRAM needing a disk write."""
        self._offered[judged_bin(judged)] += self._weight(now)
        self._departures += 1
        if self._departures % REFRESH == 0:
            self.threshold = self._tuned(rates, now)

    def _tuned(self, rates: ReturnRates, now: float) -> float:
        if self.loss == 0.0:
            return 0.0
        scale = self._weight(now)
        hits, lost, refused_back = self._hits / scale, self._lost / scale, self._refused_back / scale
        least, most = FEEDBACK
        feedback = min(most, max(least, (self.loss * hits + SMOOTHING) / (lost + SMOOTHING)))
        per_return = (lost + SMOOTHING) / (refused_back + SMOOTHING)
        back, expected = rates.refusals()
        trust = (back + SMOOTHING) / (expected + SMOOTHING)
        allowed = self.loss * hits * feedback / (per_return * trust)
        spent = evidence = tuned = 0.0
        for index in range(RATE_BINS):
            spent += self._offered[index] / scale * (bin_edge(index) + bin_edge(index + 1)) / 2
            if spent > allowed:
                break
            evidence += rates.judged(index, now)
            if evidence >= rates.weight:
                tuned = bin_edge(index + 1)
        return tuned
