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

Shared by every client of a service, so bounded for each: a prediction or hint names its
`owner` (a uid), and an owner other than `trusted` holds at most a SHARE-th of
`max_pending` (its own oldest goes first), so a co-tenant's hints cannot push out the
owner's predictions, nor, as only the trusted owner's chains make everyone's return rate
and gaps, change how a new family of the owner's is predicted; at most `max_families`
families are remembered (the least recently finished is forgotten), each with at most
`history` gaps. Every operation is O(its keys).
"""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
from collections import OrderedDict, deque
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
    owner: int | None = field(compare=False, default=None)


SHARE = 4  # an owner other than the trusted one holds at most 1/SHARE of the pending predictions


@dataclass
class _Family:
    """A prefix family's finished chains, how many came back, and their recent gaps."""

    finishes: int = 0
    returns: int = 0
    gaps: deque[float] = field(default_factory=deque)


class NextTurnPredictor:
    def __init__(self, *, lead_s: float = 1.0, max_pending: int = 4096, quantile: float = 0.2,
                 default_gap_s: float = 0.0, min_return_rate: float = 0.75, history: int = 32,
                 trusted: int | None = None, max_families: int | None = None) -> None:
        self.lead_s = lead_s
        self.min_return_rate = min_return_rate
        self.max_pending = max_pending
        self.quantile = quantile
        self.default_gap_s = default_gap_s
        self.trusted = trusted
        self.max_families = 4 * max_pending if max_families is None else max_families
        self._history = history
        self._families: OrderedDict[bytes, _Family] = OrderedDict()  # least recently finished first
        self._total = [0, 0]  # finished chains seen, of those continued later (every family)
        self._all_gaps: deque[float] = deque(maxlen=4 * history)
        # tail -> (finish, family, owner), not back yet
        self._finished_at: dict[bytes, tuple[float, bytes, int | None]] = {}
        self._queue: list[_Pending] = []  # by due time; entries no longer live are skipped
        self._live: dict[bytes, int] = {}  # tail -> the order of its one live prediction, oldest first
        self._owners: dict[int | None, dict[bytes, None]] = {}  # owner -> its live tails, oldest first
        self._owner_of: dict[bytes, int | None] = {}
        self._order = itertools.count()

    def arrived(self, keys: list[bytes], now: float) -> None:
        """A request of `keys` arrived: if it continues finished chains, their gaps are learned."""
        for key in keys:
            finished = self._finished_at.pop(key, None)
            if finished is None:
                continue
            self._drop(key)
            gap = max(0.0, now - finished[0])
            if self._counts_for_everyone(finished[2]):
                self._total[1] += 1
                self._all_gaps.append(gap)
            family = self._families.get(finished[1])
            if family is not None:
                family.returns += 1
                family.gaps.append(gap)
                if len(family.gaps) > self._history:
                    family.gaps.popleft()

    def finished(self, keys: list[bytes], now: float, owner: int | None = None) -> None:
        """A request of `keys` (prompt and answer) ended: expect its continuation."""
        if not keys:
            return
        name = keys[0]
        self._finished_at.pop(keys[-1], None)
        self._finished_at[keys[-1]] = (now, name, owner)
        while len(self._finished_at) > self.max_pending:  # forget the oldest finish
            del self._finished_at[next(iter(self._finished_at))]
        if self.return_rate(name) >= self.min_return_rate:
            self._push(keys, now + self.predicted_gap(name) - self.lead_s, owner)
        family = self._families.pop(name, None) or _Family()
        family.finishes += 1
        self._families[name] = family  # the most recently finished
        while len(self._families) > self.max_families:
            del self._families[next(iter(self._families))]
        if self._counts_for_everyone(owner):
            self._total[0] += 1

    def _counts_for_everyone(self, owner: int | None) -> bool:
        """Whether a chain of `owner` feeds everyone's rate and gaps (what a new family is
        predicted by): the trusted owner's only, so a co-tenant's chains that never come
        back, or come back late, cannot stop or delay the predictions of the owner's."""
        return self.trusted is None or owner == self.trusted

    def return_rate(self, family: bytes) -> float:
        """How often this family's finished chains were continued; everyone's while it has
        few finishes; 1.0 before anything was seen (as the connector always warmed the last
        turn)."""
        known = self._families.get(family)
        own = (known.finishes, known.returns) if known is not None else (0, 0)
        return return_rate(own, self._total, _MIN_SAMPLES, unknown=1.0)

    def expect(self, keys: list[bytes], at: float, owner: int | None = None) -> None:
        """A hint: `keys` are wanted at `at` (fetched `lead_s` before); a time that is not
        finite is ignored (it would never fall due, or sort nowhere in the queue)."""
        if keys and math.isfinite(at):
            self._push(keys, at - self.lead_s, owner)

    def predicted_gap(self, family: bytes) -> float:
        """The gap after which most of this family's requests were back (a low quantile)."""
        known = self._families.get(family)
        gaps = known.gaps if known is not None else None
        sample = gaps if gaps is not None and len(gaps) >= _MIN_SAMPLES else self._all_gaps
        if len(sample) < _MIN_SAMPLES:
            return self.default_gap_s
        cuts = statistics.quantiles(sample, n=20, method="inclusive")
        return cuts[max(0, min(len(cuts) - 1, round(self.quantile * 20) - 1))]

    def due(self, now: float) -> list[tuple[tuple[bytes, ...], int | None]]:
        """Chains to bring into DRAM now, each once, with the owner whose finish or hint
        predicted it (its promotion waits in that owner's turn)."""
        chains = []
        while self._queue and self._queue[0].due <= now:
            pending = heapq.heappop(self._queue)
            if self._live.get(pending.tail) == pending.order:
                self._drop(pending.tail)
                chains.append((pending.keys, pending.owner))
        return chains

    def next_due(self) -> float | None:
        """When the earliest prediction falls due (a timer sleeps until then)."""
        while self._queue and self._live.get(self._queue[0].tail) != self._queue[0].order:
            heapq.heappop(self._queue)
        return self._queue[0].due if self._queue else None

    def _push(self, keys: list[bytes], due: float, owner: int | None) -> None:
        tail = keys[-1]
        self._drop(tail)
        order = next(self._order)
        self._live[tail] = order
        self._owner_of[tail] = owner
        self._owners.setdefault(owner, {})[tail] = None
        heapq.heappush(self._queue, _Pending(due, order, tuple(keys), tail, owner))
        mine = self._owners[owner]
        if owner != self.trusted and len(mine) > max(1, self.max_pending // SHARE):
            self._drop(next(iter(mine)))  # a co-tenant's oldest, never another's
        if len(self._live) > self.max_pending:  # the oldest prediction goes
            self._drop(next(iter(self._live)))
        if len(self._queue) > 2 * self.max_pending:  # drop dead entries now and then
            self._queue = [p for p in self._queue if self._live.get(p.tail) == p.order]
            heapq.heapify(self._queue)

    def _drop(self, tail: bytes) -> None:
        """The live prediction of `tail`, if any, is no more (its queue entry is skipped)."""
        if self._live.pop(tail, None) is None:
            return
        owner = self._owner_of.pop(tail)
        mine = self._owners[owner]
        del mine[tail]
        if not mine:
            del self._owners[owner]
