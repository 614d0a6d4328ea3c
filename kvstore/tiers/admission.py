"""Disk admission: which chunks leaving DRAM are worth an SSD write.

Most chunks of real traffic are computed once and never asked for again; writing them
spends the SSD's endurance and write bandwidth and pushes a useful chunk off the disk.
A policy sees every chain a request stores or reads (`see`) and says whether a chunk
may be written to disk now (`admit`); the `learned` one also hears how requests ended
(`finished`), which chunks left DRAM and whether with a disk copy (`left`), and tells
stores (`stored`: it infers their requests' ends) from reads (`served`: its loss budget's
hits) apart. Policies (ADMISSIONS, named in the config's `disk_admission`):
  all           every chunk (the store's behaviour before admission existed)
  second-touch  a chunk seen `min_seen` (2) times while still remembered in a bounded
                ghost list (least recently seen forgotten first)
  tinylfu       a chunk whose estimated frequency, in a count-min sketch whose counters
                are halved every `10 x width` sightings (aging), reaches `min_seen`
  predicted     a chunk seen twice, or one whose prefix family (chains since the last
                chunk where chains sharing their prefix diverged: policy.py) has had at
                least RETURN_RATE of its chunks come back: its new chunks will likely too
                (everyone's rate, halved as it grows so recent families weigh most, stands
                for a family with few chunks)
  learned       a chunk whose bucket (return_rates.py: the answer length, turn and idle
                time of the request that last named it, its chain's length, whether an
                earlier request named the chunk and whether it came back before) has come
                back after leaving DRAM at least the threshold's share of the time: the
                threshold tuned to a loss budget (loss_budget.py: from 0, admitting all,
                until returns are measured), never below `threshold`
Each is made from (min_seen, capacity) and takes what it needs (make_admission); `learned`
is tuned apart (`Tuning`: its least threshold and its loss budget).
Invariants: every policy's memory is bounded (`capacity` keys or sketch counters)
however many distinct chunks pass; `admit` and `rate_of` never change state. Not
thread-safe: TierPolicy (policy.py) calls them under its lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

from kvstore.tiers.chain_history import InferredEnds
from kvstore.tiers.loss_budget import LOSS, LossBudget
from kvstore.tiers.next_turn import return_rate
from kvstore.tiers.return_rates import RequestEnd, ReturnRates

TRACKED_KEYS = 1 << 16
RETURN_RATE = 0.5  # `predicted`: a family whose chunks came back at least this often
_FAMILY_MIN = 8  # `predicted`: a family's own rate counts once it has this many chunks
THRESHOLD = 0.0  # `learned`: the least threshold, whatever the loss budget
_HALVE = bytes(i >> 1 for i in range(256))  # counter aging, one table lookup per byte


class Admission(Protocol):
    name: str

    def see(self, keys: Sequence[bytes], family: bytes) -> None:
        """A request stored or read these chunks of one chain of prefix family `family`."""

    def admit(self, key: bytes) -> bool:
        """Whether the disk takes this chunk now."""

    def finished(self, keys: Sequence[bytes], end: RequestEnd) -> None:
        """A request that named these chunks ended so."""

    def left(self, key: bytes, written: bool) -> None:
        """The chunk left DRAM (`written`: with a disk copy, made now or before)."""

    def rate_of(self, key: bytes) -> float:
        """How likely the chunk is to come back once out of DRAM (1: as far as it knows, sure)."""


class Unlearned:
    """What the policies that learn nothing from ends and departures answer about them."""

    def finished(self, keys: Sequence[bytes], end: RequestEnd) -> None:
        pass

    def left(self, key: bytes, written: bool) -> None:
        pass

    def rate_of(self, key: bytes) -> float:
        return 1.0


class AdmitAll(Unlearned):
    name = "all"

    def __init__(self, min_seen: int = 2, capacity: int = TRACKED_KEYS) -> None:
        """Takes what every policy takes (make_admission), and needs none of it."""

    def see(self, keys: Sequence[bytes], family: bytes) -> None:
        pass

    def admit(self, key: bytes) -> bool:
        return True


class SecondTouch(Unlearned):
    """Admit on the `min_seen`-th sighting; the ghost list remembers `capacity` keys."""

    name = "second-touch"

    def __init__(self, min_seen: int = 2, capacity: int = TRACKED_KEYS) -> None:
        self.min_seen = min_seen
        self.capacity = capacity
        self._seen: OrderedDict[bytes, int] = OrderedDict()

    def see(self, keys: Sequence[bytes], family: bytes) -> None:
        for key in keys:
            self._seen[key] = self._seen.pop(key, 0) + 1
            if len(self._seen) > self.capacity:
                self._seen.popitem(last=False)

    def count(self, key: bytes) -> int:
        return self._seen.get(key, 0)

    def admit(self, key: bytes) -> bool:
        return self.min_seen <= 1 or self.count(key) >= self.min_seen


class TinyLFU(Unlearned):
    """A count-min sketch (4 rows of 8-bit saturating counters, each row at least as wide as
    `capacity`, the chunks the tiers hold) with periodic halving, so a chunk popular long
    ago does not stay admitted forever."""

    name = "tinylfu"
    ROWS = 4

    def __init__(self, min_seen: int = 2, capacity: int = TRACKED_KEYS) -> None:
        self.min_seen = min_seen
        self.width = 1 << max(4, (capacity - 1).bit_length())
        self._rows = [bytearray(self.width) for _ in range(self.ROWS)]
        self._sample = 10 * self.width  # sightings between two halvings
        self._added = 0

    def _cells(self, key: bytes) -> list[int]:
        digest = xxhash.xxh3_128_intdigest(key)
        return [(digest >> (32 * row)) & (self.width - 1) for row in range(self.ROWS)]

    def estimate(self, key: bytes) -> int:
        return min(row[cell] for row, cell in zip(self._rows, self._cells(key), strict=True))

    def see(self, keys: Sequence[bytes], family: bytes) -> None:
        for key in keys:
            cells = self._cells(key)
            least = min(row[cell] for row, cell in zip(self._rows, cells, strict=True))
            for row, cell in zip(self._rows, cells, strict=True):
                if row[cell] == least and least < 255:  # conservative update
                    row[cell] += 1
            self._added += 1
            if self._added >= self._sample:
                self._rows = [bytearray(row.translate(_HALVE)) for row in self._rows]
                self._added //= 2

    def admit(self, key: bytes) -> bool:
        return self.min_seen <= 1 or self.estimate(key) >= self.min_seen


class Predicted(Unlearned):
    """Second touch, plus first-touch admission for families whose chunks come back."""

    name = "predicted"

    def __init__(self, min_seen: int = 2, capacity: int = TRACKED_KEYS) -> None:
        self.ghost = SecondTouch(min_seen, capacity)
        self.capacity = capacity
        self._family: OrderedDict[bytes, bytes] = OrderedDict()  # chunk -> its family
        self._counts: OrderedDict[bytes, list[int]] = OrderedDict()  # family -> [chunks, came back]
        self._total = [0, 0]  # every family's [chunks, came back], halved as it grows (aging)

    def see(self, keys: Sequence[bytes], family: bytes) -> None:
        counts = self._counts.pop(family, None) or [0, 0]
        self._counts[family] = counts
        if len(self._counts) > self.capacity:
            self._counts.popitem(last=False)
        for key in keys:
            back = key in self._family
            if back and self.ghost.count(key) == 1:  # its first return
                known = self._counts.get(self._family[key])
                if known is not None:
                    known[1] += 1
                self._total[1] += 1
            elif not back:
                counts[0] += 1
                self._total[0] += 1
                self._family[key] = family
                if len(self._family) > self.capacity:
                    self._family.popitem(last=False)
        if self._total[0] >= 10 * self.capacity:  # the recent families' behaviour weighs most
            self._total = [n // 2 for n in self._total]
        self.ghost.see(keys, family)

    def return_rate(self, family: bytes) -> float:
        """The share of this family's chunks seen again (everyone's while it has few)."""
        return return_rate(self._counts.get(family, (0, 0)), self._total, _FAMILY_MIN, unknown=0.0)

    def admit(self, key: bytes) -> bool:
        if self.ghost.admit(key):
            return True
        family = self._family.get(key)
        return family is not None and self.return_rate(family) >= RETURN_RATE


@dataclass(frozen=True)
class Tuning:
    """How `learned` admission is tuned: the least threshold it asks whatever its budget
    allows, and its loss budget (the share of hits it may give up: loss_budget.py)."""

    threshold: float = THRESHOLD
    loss: float = LOSS

    def __post_init__(self) -> None:
        if not (0.0 <= self.threshold <= 1.0 and 0.0 <= self.loss <= 1.0):  # NaN too
            raise ValueError(f"a threshold of {self.threshold} and a loss budget of {self.loss}: each 0 to 1")


class Learned:
    """Admit a chunk whose bucket's return rate (ReturnRates) is at least the threshold: the
    loss budget's (`budget`, LossBudget), or `floor` if that is higher."""

    name = "learned"

    def __init__(self, min_seen: int = 2, capacity: int = TRACKED_KEYS) -> None:
        """Takes what every policy takes (make_admission); `min_seen` it does not need. Its
        `clock` (TierPolicy's: the trace's in a replay) times departures and returns."""
        self.floor = THRESHOLD
        self.rates = ReturnRates(capacity)
        self.budget = LossBudget()
        self.ends = InferredEnds()
        self.clock: Callable[[], float] = time.monotonic

    def tune(self, tuning: Tuning) -> None:
        """Ask at least `tuning.threshold`, and give up at most `tuning.loss` of the hits;
        what was learned stays."""
        self.floor, self.budget.loss = tuning.threshold, tuning.loss

    @property
    def threshold(self) -> float:
        return max(self.floor, self.budget.threshold)

    def see(self, keys: Sequence[bytes], family: bytes) -> None:
        self._named(keys, self.clock())

    def stored(self, keys: Sequence[bytes], parent: bytes | None) -> None:
        """A request stored these chunks of one chain, `parent` before the first: named, and
        labelled as its end can be inferred where no reported end labels them."""
        now = self.clock()
        end, chunks = self.ends.put(keys, parent, now)
        self.rates.inferred(list(keys), end, chunks)
        self._named(keys, now)

    def served(self, keys: Sequence[bytes]) -> None:
        """A request read these chunks of one chain from the store: named, and hits."""
        now = self.clock()
        self._named(keys, now)
        self.budget.served(len(keys), now)

    def _named(self, keys: Sequence[bytes], now: float) -> None:
        lost, refused_back = self.rates.named(keys, now)
        if lost:
            self.budget.lost(lost, refused_back, now)

    def finished(self, keys: Sequence[bytes], end: RequestEnd) -> None:
        self.rates.finished(keys, end)

    def left(self, key: bytes, written: bool) -> None:
        now = self.clock()
        judged, needed = self.rates.left(key, now, written)
        if needed:
            self.budget.offered(judged, now, self.rates)

    def rate_of(self, key: bytes) -> float:
        return self.rates.rate_of(key, self.clock())

    def admit(self, key: bytes) -> bool:
        return self.rate_of(key) >= self.threshold

    def describe(self) -> dict[str, float]:
        """The threshold now, its floor, the loss budget and the loss measured lately."""
        return {"threshold": self.threshold, "threshold_floor": self.floor, "loss_budget": self.budget.loss,
                "loss_measured": self.budget.measured()}


ADMISSIONS: dict[str, Callable[[int, int], Admission]] = {
    policy.name: policy for policy in (AdmitAll, SecondTouch, TinyLFU, Predicted, Learned)}


def make_admission(name: str, min_seen: int = 2, capacity: int = TRACKED_KEYS) -> Admission:
    """The named policy (ADMISSIONS) remembering `capacity` keys; a bad name is a ValueError
    naming the known ones."""
    if name not in ADMISSIONS:
        raise ValueError(f"disk admission {name!r}: one of {', '.join(ADMISSIONS)}")
    return ADMISSIONS[name](min_seen, capacity)
