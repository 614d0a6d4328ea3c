"""Which chunks come back after they leave DRAM, learned per bucket of the request that
last named them (the `learned` disk admission, admission.py).

A request that ends is described by what the connector knows of it (`RequestEnd`: its
answer's length, how many times the chain it extends had been extended before, the
conversation's turn, and how long that chain had been idle) and by its length in chunks.
Its chunks are labelled with that bucket, split again by whether an earlier request had
named the chunk too (a shared prefix, or a document asked about again), whether the
chunk has come back before, and whether it is the chain's last chunk (TAIL_CHUNKS: a next
turn often does not reuse it). When a chunk leaves DRAM it is a departure of its bucket, and
when a later request names it again (stores or reads it) while it is remembered, a return.
A chunk named before or come back that leaves DRAM late (more than LATE times the mean time
chunks stay unnamed before they leave: its conversation has likely ended) is a departure of
a bucket of its split alone, whatever its request's: how such chunks come back is learned
apart, and they are few, so a bucket's request features would leave it without exposure.

A bucket's return rate is its returns over its departures' exposure. A departure that has
not come back yet may still: counting it in full at once would take every bucket for one
that never returns until its returns arrive (minutes, when people come back to a
conversation). So a departure counts in proportion to the time it has been out, up to
`ramp_s` (twice the mean delay of the returns seen, at least RAMP_S[0]), and in full after
or once it has come back. The rate is drawn toward everyone's while a bucket has little
exposure (`PRIOR_WEIGHT`), and everyone's toward 1: before anything is learned nothing is
refused. A chunk with no label (its request never said how it ended) is in bucket 0 (of
its split), which learns like any other.

Invariants: memory is bounded whatever passes: at most `capacity` labels, `capacity`
times chunks were last named, `capacity` departed chunks, `capacity` chunks seen back and
`capacity` queued departures (the least
recent forgotten first, a forgotten departure counted in full), and a few numbers per
bucket (BUCKETS of them); the counts are halved once `capacity` departures have been
counted since the last halving, so a change of traffic is followed. Only `finished`,
`left`, `named` and `restore` change state; `rate`, `rate_of` and `state` never do. Not
thread-safe (TierPolicy calls it under its lock).

What was learned outlives the process: `state()` is every bucket's counts (not the
chunks' labels or the departures still out, which name keys), and `restore` takes one
back, checked field by field, so a restarted service admits as the old one did from its
first eviction instead of learning again from cold (minutes, when returns take minutes).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

ANSWER_EDGES = (8, 16, 32, 64, 128, 256, 512, 1024)  # answer tokens: 9 bins
TURN_EDGES = (1, 2, 3, 6)  # times the chain had been extended: 0, 1, 2, 3-5, 6+
IDLE_EDGES = (10.0, 60.0, 300.0, 1800.0)  # seconds idle before the request: 5 bins, and "new"
LENGTH_EDGES = (4, 16, 24, 32, 48, 64, 96)  # chunks in the chain: 8 bins
UNKNOWN = 0  # the bucket of a chunk whose request did not say how it ended
ENDS = 1 + (len(ANSWER_EDGES) + 1) * (len(TURN_EDGES) + 1) * (len(IDLE_EDGES) + 2) * (len(LENGTH_EDGES) + 1)
TAIL_CHUNKS = 1  # a chain's last chunks: a bucket of their own (they come back less often)
NAMED, BACK, TAIL = ENDS, 2 * ENDS, 4 * ENDS  # a split's offset: each split has ENDS buckets
LATE_SPLIT = 8 * ENDS  # then one bucket per split for the chunks that left DRAM late (used by
# the splits of chunks named before or come back: 6 of the 8)
LATE = 1.75  # a chunk left DRAM late: unnamed this many times the mean time chunks were before leaving
BUCKETS = 8 * ENDS + 8  # the 8 splits (named before, come back before, last chunk) and the late ones
PRIOR_WEIGHT = 4.0  # departures' worth of everyone's rate in a bucket's own
RAMP_S = (300.0, 300.0, 3600.0)  # a departure's exposure ramp: least, before any return, most
MAX_TOKENS = 1 << 31  # an answer's tokens, and a chain's turns, as the protocol bounds them
MAX_IDLE_S = 1e9  # seconds: about 32 years
STATE_VERSION = 2  # of `state()`: the bucket layout above is part of it
MAX_COUNT = 1e15  # a stored count past this is not one a process made


@dataclass(frozen=True)
class RequestEnd:
    """What is known of a request when it ends: its answer's tokens, how many times the
    chain it extends had been extended (0: a new chain), and how long that chain had been
    idle before it arrived (None: a new chain)."""

    answer_tokens: int
    turn: int = 0
    idle_s: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.answer_tokens <= MAX_TOKENS or not 0 <= self.turn <= MAX_TOKENS:
            raise ValueError(f"answer_tokens {self.answer_tokens} and turn {self.turn}: 0 to {MAX_TOKENS}")
        if self.idle_s is not None and not (math.isfinite(self.idle_s) and 0 <= self.idle_s <= MAX_IDLE_S):
            raise ValueError(f"idle_s {self.idle_s}: a number of seconds from 0 to {MAX_IDLE_S:g}")

    def bucket(self, chunks: int = 1) -> int:
        """1 .. ENDS - 1: the answer's, the turn's, the idle time's and the chain length's bins together."""
        answer = bisect.bisect_right(ANSWER_EDGES, self.answer_tokens)
        turn = bisect.bisect_right(TURN_EDGES, self.turn)
        idle = 0 if self.idle_s is None else 1 + bisect.bisect_right(IDLE_EDGES, self.idle_s)
        length = bisect.bisect_right(LENGTH_EDGES, chunks)
        request = (answer * (len(TURN_EDGES) + 1) + turn) * (len(IDLE_EDGES) + 2) + idle
        return 1 + request * (len(LENGTH_EDGES) + 1) + length


class ReturnRates:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._label: OrderedDict[bytes, int] = OrderedDict()  # chunk -> its last request's bucket
        self._came_back: OrderedDict[bytes, None] = OrderedDict()  # chunks seen back at least once
        # chunks out of DRAM and not back: [bucket, when it left, still within its ramp]
        self._departed: OrderedDict[bytes, list[Any]] = OrderedDict()
        self._young: deque[tuple[float, bytes]] = deque()  # departures as they left, oldest first
        self.returns = [0.0] * BUCKETS
        self.settled = [0.0] * BUCKETS  # departures counted in full
        self._ramping = [[0, 0.0] for _ in range(BUCKETS + 1)]  # within the ramp: count, sum of times
        self._totals = [0.0, 0.0]  # every bucket's returns and settled departures
        self._delay = [0.0, 0.0]  # returns seen and their delays' sum (halved with the counts)
        self._since_halving = 0
        self._now = 0.0
        self._named_at: OrderedDict[bytes, float] = OrderedDict()  # chunk -> when it was last named
        self._age = [0.0, 0.0]  # departures of named chunks and their times unnamed (halved with the counts)

    @property
    def ramp_s(self) -> float:
        """How long a departure takes to count in full: twice the mean delay of returns seen."""
        least, unknown, most = RAMP_S
        mean = self._delay[1] / self._delay[0] if self._delay[0] else unknown / 2
        return min(most, max(least, 2 * mean))

    def finished(self, keys: Iterable[bytes], end: RequestEnd) -> None:
        """A request that named these chunks ended so: they are its bucket's now."""
        keys = list(keys)
        bucket = end.bucket(len(keys))
        tail = len(keys) - TAIL_CHUNKS
        for index, key in enumerate(keys):  # named before: shared
            self._label[key] = bucket + (NAMED if key in self._label else 0) + (TAIL if index >= tail else 0)
            self._label.move_to_end(key)
        while len(self._label) > self.capacity:
            self._label.popitem(last=False)

    def left(self, key: bytes, now: float) -> None:
        """The chunk left DRAM: a departure of its bucket, remembered until it returns."""
        self._advance(now)
        if key in self._departed:  # out again without having been seen back
            self._settle(key)
        bucket = self.bucket_of(key, self._now)
        named_at = self._named_at.get(key)
        if named_at is not None:
            self._age[0] += 1
            self._age[1] += self._now - named_at
        self._departed[key] = [bucket, self._now, True]
        self._young.append((self._now, key))
        for ramping in (self._ramping[bucket], self._ramping[BUCKETS]):
            ramping[0] += 1
            ramping[1] += self._now
        while len(self._departed) > self.capacity:  # forgotten: it can no longer be seen back
            self._settle(next(iter(self._departed)))
        self._since_halving += 1
        if self._since_halving >= self.capacity:
            for counts in (self.returns, self.settled, self._totals, self._delay, self._age):
                counts[:] = [n / 2 for n in counts]
            self._since_halving = 0

    def named(self, keys: Iterable[bytes], now: float) -> None:
        """A request stored or read these chunks: those that had left DRAM came back."""
        self._advance(now)
        for key in keys:
            self._named_at[key] = self._now
            self._named_at.move_to_end(key)
            if len(self._named_at) > self.capacity:
                self._named_at.popitem(last=False)
            departed = self._departed.get(key)
            if departed is None:
                continue
            self._settle(key)
            self.returns[departed[0]] += 1
            self._totals[0] += 1
            self._delay[0] += 1
            self._delay[1] += self._now - departed[1]
            self._came_back[key] = None
            self._came_back.move_to_end(key)
            if len(self._came_back) > self.capacity:
                self._came_back.popitem(last=False)

    def _settle(self, key: bytes) -> None:
        """The departure is no longer watched for a return: counted in full if it was not yet."""
        departed = self._departed.pop(key)
        if departed[2]:
            self._full(departed)

    def _full(self, departed: list[Any]) -> None:
        bucket, when, _ = departed
        departed[2] = False
        for ramping in (self._ramping[bucket], self._ramping[BUCKETS]):
            ramping[0] -= 1
            ramping[1] -= when
        self.settled[bucket] += 1
        self._totals[1] += 1

    def _advance(self, now: float) -> None:
        """Departures out for a whole ramp count in full from now on."""
        self._now = max(self._now, now)
        cutoff = self._now - self.ramp_s
        while self._young and (self._young[0][0] <= cutoff or len(self._young) > self.capacity):
            when, key = self._young.popleft()
            departed = self._departed.get(key)
            if departed is not None and departed[1] == when and departed[2]:
                self._full(departed)

    def _exposure(self, bucket: int, now: float) -> float:
        """Departures counted in full, and those within the ramp in proportion to their time
        out by `now` (at most in full, though not yet moved out of the ramp)."""
        count, times = self._ramping[bucket]
        young = min(float(count), max(0.0, (count * max(now, self._now) - times) / self.ramp_s))
        return (self.settled[bucket] if bucket < BUCKETS else self._totals[1]) + young

    def overall(self, now: float = 0.0) -> float:
        """Everyone's return rate at `now`, drawn toward 1 while few chunks have left DRAM."""
        return (self._totals[0] + PRIOR_WEIGHT) / (self._exposure(BUCKETS, now) + PRIOR_WEIGHT)

    def rate(self, bucket: int, now: float = 0.0) -> float:
        """The bucket's return rate at `now` (the last event's time if later), drawn toward
        everyone's while it has little exposure."""
        prior = PRIOR_WEIGHT * self.overall(now)
        return (self.returns[bucket] + prior) / (self._exposure(bucket, now) + PRIOR_WEIGHT)

    def state(self) -> dict[str, Any]:
        """What was learned, per bucket: enough for `restore` in a later process."""
        return {"version": STATE_VERSION, "buckets": BUCKETS, "returns": list(self.returns),
                "settled": list(self.settled), "totals": list(self._totals), "delay": list(self._delay),
                "age": list(self._age)}

    def restore(self, state: object) -> None:
        """Take over what a `state()` says was learned; ValueError, and nothing changed, when
        it is not a state of this version and bucket layout."""
        counts = _checked_state(state)
        self.returns, self.settled = counts["returns"], counts["settled"]
        self._totals, self._delay, self._age = counts["totals"], counts["delay"], counts["age"]

    def bucket_of(self, key: bytes, now: float | None = None) -> int:
        """The bucket of the request that last named this chunk, and whether it came back
        before; if it was named before or came back and, at `now`, has been unnamed LATE
        times as long as departing chunks were on average, its split's late bucket."""
        bucket = self._label.get(key, UNKNOWN) + (BACK if key in self._came_back else 0)
        split = bucket // ENDS  # its split, 0-7: the sum of those of NAMED, BACK and TAIL it is in
        named_at = self._named_at.get(key)
        if (now is None or named_at is None or not self._age[0] or not split & (NAMED + BACK) // ENDS
                or now - named_at <= LATE * self._age[1] / self._age[0]):
            return bucket
        return LATE_SPLIT + split

    def rate_of(self, key: bytes, now: float = 0.0) -> float:
        """The return rate of the chunk's bucket (bucket_of) at `now`."""
        return self.rate(self.bucket_of(key, max(now, self._now)), now)


def _checked_state(state: object) -> dict[str, list[float]]:
    """The counts of a `state()`, each list its length and each count a finite number from
    0 to MAX_COUNT; ValueError saying what is wrong otherwise."""
    lengths = {"returns": BUCKETS, "settled": BUCKETS, "totals": 2, "delay": 2, "age": 2}
    if not isinstance(state, dict) or set(state) != {"version", "buckets", *lengths}:
        raise ValueError(f"learned rates: a mapping of exactly version, buckets, {', '.join(lengths)}")
    if state["version"] != STATE_VERSION or state["buckets"] != BUCKETS:
        raise ValueError(f"learned rates of version {state['version']!r} with {state['buckets']!r} buckets; "
                         f"this kvstore keeps version {STATE_VERSION} with {BUCKETS}")
    counts: dict[str, list[float]] = {}
    for name, length in lengths.items():
        values = state[name]
        if not isinstance(values, list) or len(values) != length or not all(
                type(v) in (int, float) and 0 <= v <= MAX_COUNT for v in values):
            raise ValueError(f"learned rates: {name} must be {length} counts from 0 to {MAX_COUNT:g}")
        counts[name] = [float(v) for v in values]
    return counts
