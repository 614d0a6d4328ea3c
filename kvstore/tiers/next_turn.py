"""When a finished request's chunks will be wanted again, learned from what arrives.

A conversation's next turn (or an agent's next step) is a request whose chunks extend a
finished one's: its keys contain the finished chain's last key. The gap between the
finish and that arrival is learned per prefix family (chains sharing a first chunk: a
system prompt, an agent's instructions) and across all families; the predicted gap is a
low quantile of the recent ones, so most returns find their chunks in DRAM (a family's
own gaps once it has a few, else everyone's). Only families whose finished chains come
back at least `min_return_rate` of the time (everyone's rate for a family with few
finishes) are predicted: a read ahead of a chain that never returns is a wasted read and
a DRAM slot taken from one that does. `due(now)` names the chains to bring back into
DRAM now, `lead_s` before the predicted return. Invariants: one prediction per
finished chain; at most `max_pending` wait (the oldest goes first), so the DRAM a
prediction claims and the reads it costs are bounded; a chain is fetched once per
finish; a conversation that comes back before its prediction is due cancels it (the
arrival fetches what it needs itself). Explicit hints go through the same queue:
`expect(keys, at)` says a chain is wanted at a given time.
"""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

_MIN_SAMPLES = 3  # a family's own gaps count once it has this many


def return_rate(own: Sequence[int], overall: Sequence[int], min_samples: int, unknown: float) -> float:
    """From (seen, came back) counts: the share of a family's that came back once it has
    `min_samples`, else everyone's, else `unknown` (also Predicted's, admission.py)."""
    seen, back = own if own[0] >= min_samples else overall
    return back / seen if seen >= min_samples else unknown


@dataclass(order=True)
class _Pending:
    due: float
    order: int
    keys: tuple[bytes, ...] = field(compare=False)
    tail: bytes = field(compare=False)


class NextTurnPredictor:
    def __init__(self, *, lead_s: float = 1.0, max_pending: int = 4096, quantile: float = 0.2,
                 default_gap_s: float = 0.0, min_return_rate: float = 0.75, history: int = 32) -> None:
        self.lead_s = lead_s
        self.min_return_rate = min_return_rate
        self._finishes: dict[bytes, int] = {}  # family -> finished chains seen
        self._returns: dict[bytes, int] = {}  # family -> of those, continued later
        self._total = [0, 0]  # finished chains seen, of those continued later (every family)
        self.max_pending = max_pending
        self.quantile = quantile
        self.default_gap_s = default_gap_s
        self._history = history
        self._gaps: dict[bytes, deque[float]] = {}
        self._all_gaps: deque[float] = deque(maxlen=4 * history)
        self._finished_at: dict[bytes, tuple[float, bytes]] = {}  # tail -> (finish, family), not back yet
        self._queue: list[_Pending] = []  # by due time; entries no longer live are skipped
        self._live: dict[bytes, int] = {}  # tail -> the order of its one live prediction
        self._order = itertools.count()

    def arrived(self, keys: list[bytes], now: float) -> None:
        """A request of `keys` arrived: if it continues finished chains, their gaps are learned."""
        for key in keys:
            finished = self._finished_at.pop(key, None)
            if finished is None:
                continue
            self._live.pop(key, None)
            self._returns[finished[1]] = self._returns.get(finished[1], 0) + 1
            self._total[1] += 1
            gap = max(0.0, now - finished[0])
            self._gaps.setdefault(finished[1], deque(maxlen=self._history)).append(gap)
            self._all_gaps.append(gap)

    def finished(self, keys: list[bytes], now: float) -> None:
        """A request of `keys` (prompt and answer) ended: expect its continuation."""
        if not keys:
            return
        family = keys[0]
        self._finished_at[keys[-1]] = (now, family)
        while len(self._finished_at) > self.max_pending:  # forget the oldest finish
            del self._finished_at[next(iter(self._finished_at))]
        if self.return_rate(family) >= self.min_return_rate:
            self._push(keys, now + self.predicted_gap(family) - self.lead_s)
        self._finishes[family] = self._finishes.get(family, 0) + 1
        self._total[0] += 1

    def return_rate(self, family: bytes) -> float:
        """How often this family's finished chains were continued; everyone's while it has
        few finishes; 1.0 before anything was seen (as the connector always warmed the last
        turn)."""
        own = (self._finishes.get(family, 0), self._returns.get(family, 0))
        return return_rate(own, self._total, _MIN_SAMPLES, unknown=1.0)

    def expect(self, keys: list[bytes], at: float) -> None:
        """A hint: `keys` are wanted at `at` (fetched `lead_s` before); a time that is not
        finite is ignored (it would never fall due, or sort nowhere in the queue)."""
        if keys and math.isfinite(at):
            self._push(keys, at - self.lead_s)

    def predicted_gap(self, family: bytes) -> float:
        """The gap after which most of this family's requests were back (a low quantile)."""
        gaps = self._gaps.get(family)
        sample = gaps if gaps is not None and len(gaps) >= _MIN_SAMPLES else self._all_gaps
        if len(sample) < _MIN_SAMPLES:
            return self.default_gap_s
        cuts = statistics.quantiles(sample, n=20, method="inclusive")
        return cuts[max(0, min(len(cuts) - 1, round(self.quantile * 20) - 1))]

    def due(self, now: float) -> list[tuple[bytes, ...]]:
        """Chains to bring into DRAM now, each once."""
        chains = []
        while self._queue and self._queue[0].due <= now:
            pending = heapq.heappop(self._queue)
            if self._live.get(pending.tail) == pending.order:
                del self._live[pending.tail]
                chains.append(pending.keys)
        return chains

    def next_due(self) -> float | None:
        """When the earliest prediction falls due (a timer sleeps until then)."""
        while self._queue and self._live.get(self._queue[0].tail) != self._queue[0].order:
            heapq.heappop(self._queue)
        return self._queue[0].due if self._queue else None

    def _push(self, keys: list[bytes], due: float) -> None:
        order = next(self._order)
        self._live[keys[-1]] = order
        heapq.heappush(self._queue, _Pending(due, order, tuple(keys), keys[-1]))
        if len(self._live) > self.max_pending:  # the oldest prediction goes
            del self._live[min(self._live, key=self._live.__getitem__)]
        if len(self._queue) > 2 * self.max_pending:  # drop dead entries now and then
            self._queue = [p for p in self._queue if self._live.get(p.tail) == p.order]
            heapq.heapify(self._queue)
