"""Which chunks come back after they leave DRAM, learned per bucket of the request that
last named them (the `learned` disk admission, admission.py).

A request that ends is described by what is known of it (`RequestEnd`: its answer's
length, how many times the chain it extends had been extended before, the conversation's
turn, and how long that chain had been idle) and by its length in chunks. The vLLM
connector reports its requests' ends (`finished`); for a put no reported end labels (SGLang's
and LMCache's backends report none), the service's inferred one does (`inferred`,
chain_history.InferredEnds: its turn and idle time from the chain's earlier puts, its
answer not known: a bin of its own). Its chunks are labelled with that bucket, split again
by whether an earlier request had named the chunk too (a shared prefix, or a document asked
about again), whether the chunk has come back before, and whether it is the chain's last
chunk (TAIL_CHUNKS: a next turn often does not reuse it). When a chunk leaves DRAM it is a
departure of its bucket, and when a later request names it again (stores or reads it)
while it is remembered, a return. A chunk named before or come back that leaves DRAM late
(more than LATE times the mean time chunks stay unnamed before they leave: its
conversation has likely ended) is a departure of a bucket of its split alone, whatever its
request's: how such chunks come back is learned apart, and they are few, so a bucket's
request features would leave it without exposure.

A bucket's return rate is its returns over its departures' exposure (tallies.py: a
departure counts in proportion to its time out until `ramp_s`, twice the mean delay of the
returns seen, at least RAMP_S[0]). A request's chunks leave DRAM and come back together, so
evidence is weighed in requests, not chunks: a bucket's rate is drawn toward its group's
(the same split, answer and turn: every idle time and chain length) as if it had
PRIOR_WEIGHT requests' departures more (`weight`: that many times the chunks a request's
chain has on average), a group's toward everyone's, and everyone's toward 1: before
anything is learned nothing is refused. A chunk with no label is in bucket 0 of its split,
which learns like any other.

Each departure that needed a disk write (it had none: `left` is told whether the chunk was
`written`) is also a departure of the bin of the rate it was judged at (`judged`: how long
such chunks have been watched, which the loss budget, loss_budget.py, asks before it
refuses any).
A refused chunk named again cost a hit, and so did every departed chunk named after it in
the same chain, whose prefix broke there (`named` counts both).

Invariants: memory is bounded whatever passes: at most `capacity` labels, `capacity`
inferred labels, `capacity` times chunks were last named, `capacity` departed chunks,
`capacity` chunks seen back and `capacity` queued departures (the least recent forgotten
first, a forgotten departure counted in full), and two numbers per tally (TALLIES of
them); the counts are halved once `capacity` departures have been counted since the last
halving, so a change of traffic is followed. Only `finished`, `inferred`, `left`, `named`
and `restore` change state; `rate`, `rate_of`, `judged` and `state` never do. Not
thread-safe (TierPolicy calls it under its lock).

What was learned outlives the process: `state()` is every tally's counts (not the chunks'
labels or the departures still out, which name keys), and `restore` takes one back,
checked field by field, so a restarted service admits as the old one did from its first
eviction instead of learning again from cold (minutes, when returns take minutes).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvstore.tiers.tallies import Tallies

ANSWER_EDGES = (8, 16, 32, 64, 128, 256, 512, 1024)  # answer tokens: 9 bins, and a 10th: not known
TURN_EDGES = (1, 2, 3, 6)  # times the chain had been extended: 0, 1, 2, 3-5, 6+
IDLE_EDGES = (10.0, 60.0, 300.0, 1800.0)  # seconds idle before the request: 5 bins, and "new"
LENGTH_EDGES = (4, 16, 24, 32, 48, 64, 96)  # chunks in the chain: 8 bins
ANSWERS, TURNS = len(ANSWER_EDGES) + 2, len(TURN_EDGES) + 1
IDLES, LENGTHS = len(IDLE_EDGES) + 2, len(LENGTH_EDGES) + 1
UNKNOWN = 0  # the bucket of a chunk no request end labels
ENDS = 1 + ANSWERS * TURNS * IDLES * LENGTHS
TAIL_CHUNKS = 1  # a chain's last chunks: a bucket of their own (they come back less often)
NAMED, BACK, TAIL = ENDS, 2 * ENDS, 4 * ENDS  # a split's offset: each split has ENDS buckets
LATE_SPLIT = 8 * ENDS  # then one bucket per split for the chunks that left DRAM late (used by
# the splits of chunks named before or come back: 6 of the 8)
LATE = 1.75  # a chunk left DRAM late: unnamed this many times the mean time chunks were before leaving
BUCKETS = 8 * ENDS + 8  # the 8 splits (named before, come back before, last chunk) and the late ones
GROUP_ENDS = 1 + ANSWERS * TURNS  # a split's groups: the unlabelled, then one per answer and turn
GROUPS = 8 * GROUP_ENDS + 8  # and each late bucket a group of its own
RATE_BINS = 100  # judged rates: bin b holds [(b / RATE_BINS)^2, ((b + 1) / RATE_BINS)^2), fine at the low end
GROUP0, EVERYONE = BUCKETS, BUCKETS + GROUPS  # the tallies: buckets, groups, everyone's, judged rates
JUDGED = EVERYONE + 1
TALLIES = JUDGED + RATE_BINS
PRIOR_WEIGHT = 4.0  # requests' departures' worth of the prior in a tally's own rate
RAMP_S = (300.0, 300.0, 3600.0)  # a departure's exposure ramp: least, before any return, most
MAX_TOKENS = 1 << 31  # an answer's tokens, and a chain's turns, as the protocol bounds them
MAX_IDLE_S = 1e9  # seconds: about 32 years
STATE_VERSION = 3  # of `state()`: the tally layout above is part of it
MAX_COUNT = 1e15  # a stored count past this is not one a process made


@dataclass(frozen=True)
class RequestEnd:
    """What is known of a request when it ends: its answer's tokens (None: not known, an
    end the service inferred), how many times the chain it extends had been extended (0: a
    new chain), and how long that chain had been idle before it arrived (None: a new chain)."""

    answer_tokens: int | None
    turn: int = 0
    idle_s: float | None = None

    def __post_init__(self) -> None:
        answer = 0 if self.answer_tokens is None else self.answer_tokens
        if not 0 <= answer <= MAX_TOKENS or not 0 <= self.turn <= MAX_TOKENS:
            raise ValueError(f"answer_tokens {self.answer_tokens} and turn {self.turn}: 0 to {MAX_TOKENS}")
        if self.idle_s is not None and not (math.isfinite(self.idle_s) and 0 <= self.idle_s <= MAX_IDLE_S):
            raise ValueError(f"idle_s {self.idle_s}: a number of seconds from 0 to {MAX_IDLE_S:g}")

    def bucket(self, chunks: int = 1) -> int:
        """1 .. ENDS - 1: the answer's, the turn's, the idle time's and the chain length's bins together."""
        known = self.answer_tokens is not None
        answer = bisect.bisect_right(ANSWER_EDGES, self.answer_tokens or 0) if known else ANSWERS - 1
        turn = bisect.bisect_right(TURN_EDGES, self.turn)
        idle = 0 if self.idle_s is None else 1 + bisect.bisect_right(IDLE_EDGES, self.idle_s)
        length = bisect.bisect_right(LENGTH_EDGES, chunks)
        return 1 + ((answer * TURNS + turn) * IDLES + idle) * LENGTHS + length


def group_of(bucket: int) -> int:
    """The bucket's group: its split's buckets of the same answer and turn bins (every idle
    time and chain length); the unlabelled bucket and each late one a group of their own."""
    if bucket >= LATE_SPLIT:
        return 8 * GROUP_ENDS + bucket - LATE_SPLIT
    split, end = divmod(bucket, ENDS)
    return split * GROUP_ENDS + (0 if end == UNKNOWN else 1 + (end - 1) // (LENGTHS * IDLES))


def judged_bin(rate: float) -> int:
    """The bin of a judged return rate (RATE_BINS of them, finer toward 0)."""
    return min(RATE_BINS - 1, int(math.sqrt(max(0.0, rate)) * RATE_BINS))


def bin_edge(index: int) -> float:
    """The least rate of judged bin `index` (RATE_BINS: 1, above every rate)."""
    return (index / RATE_BINS) ** 2


class ReturnRates:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._label: OrderedDict[bytes, int] = OrderedDict()  # chunk -> its last reported request's bucket
        self._guessed: OrderedDict[bytes, int] = OrderedDict()  # chunk -> its last inferred one's
        self._came_back: OrderedDict[bytes, bool] = OrderedDict()  # chunk seen back -> it had been written
        # chunks out of DRAM and not back: [its tallies, when it left, still within its ramp,
        # written, the rate it was judged at]
        self._departed: OrderedDict[bytes, list[Any]] = OrderedDict()
        self._young: deque[tuple[float, bytes]] = deque()  # departures as they left, oldest first
        self.tallies = Tallies(TALLIES)
        self._delay = [0.0, 0.0]  # returns seen and their delays' sum (halved with the counts)
        self._chains = [0.0, 0.0]  # request ends labelling chunks, and their chains' chunks (halved too)
        self._refused = [0.0, 0.0]  # refused chunks seen back, and the rates of those settled (halved too)
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

    @property
    def weight(self) -> float:
        """The prior's weight, in chunk departures: PRIOR_WEIGHT requests' chains."""
        return PRIOR_WEIGHT * max(1.0, self._chains[1] / self._chains[0] if self._chains[0] else 1.0)

    def finished(self, keys: Iterable[bytes], end: RequestEnd) -> None:
        """A request that named these chunks ended so (as reported): they are its bucket's now."""
        keys = list(keys)
        self._label_chain(keys, end.bucket(len(keys)), self._label)
        for key in keys:
            self._guessed.pop(key, None)

    def inferred(self, keys: list[bytes], end: RequestEnd, chunks: int) -> None:
        """A put of these chunks, the last `chunks` long of its chain, ended so as far as the
        service can tell: the bucket of those no reported end labels."""
        self._label_chain([key for key in keys if key not in self._label], end.bucket(chunks), self._guessed,
                          chunks)

    def _label_chain(self, keys: list[bytes], bucket: int, labels: OrderedDict[bytes, int],
                     chunks: int | None = None) -> None:
        tail = len(keys) - TAIL_CHUNKS
        for index, key in enumerate(keys):  # named before: shared
            labels[key] = bucket + (NAMED if key in labels else 0) + (TAIL if index >= tail else 0)
            labels.move_to_end(key)
        while len(labels) > self.capacity:
            labels.popitem(last=False)
        if keys:
            self._chains[0] += 1
            self._chains[1] += len(keys) if chunks is None else chunks

    def left(self, key: bytes, now: float, written: bool = True) -> tuple[float, bool]:
        """The chunk left DRAM (`written`: with a disk copy): a departure of its bucket,
        remembered until it returns. The rate it was judged at, and whether it needed a
        write (it had no copy before: a disk copy it came back from needs none)."""
        self._advance(now)
        if key in self._departed:  # out again without having been seen back
            self._settle(key)
        bucket = self.bucket_of(key, self._now)
        judged = self.rate(bucket, self._now)
        needed = not (written and self._came_back.get(key, False))
        named_at = self._named_at.get(key)
        if named_at is not None:
            self._age[0] += 1
            self._age[1] += self._now - named_at
        tallies: tuple[int, ...] = (bucket, GROUP0 + group_of(bucket), EVERYONE)
        if needed:  # a decision: how often chunks judged so come back
            tallies += (JUDGED + judged_bin(judged),)
        self._departed[key] = [tallies, self._now, True, written, judged]
        self._young.append((self._now, key))
        self.tallies.depart(tallies, self._now)
        while len(self._departed) > self.capacity:  # forgotten: it can no longer be seen back
            self._settle(next(iter(self._departed)))
        self._since_halving += 1
        if self._since_halving >= self.capacity:
            self.tallies.halve()
            for counts in (self._delay, self._age, self._chains, self._refused):
                counts[:] = [n / 2 for n in counts]
            self._since_halving = 0
        return judged, needed

    def named(self, keys: Iterable[bytes], now: float) -> tuple[int, int]:
        """A request stored or read these chunks (of one chain, in order): those that had left
        DRAM came back. (hits lost, refused chunks back): a chunk that left without a disk
        copy is a hit lost, and so is every departed chunk after it here."""
        self._advance(now)
        lost = refused = 0
        for key in keys:
            self._named_at[key] = self._now
            self._named_at.move_to_end(key)
            if len(self._named_at) > self.capacity:
                self._named_at.popitem(last=False)
            departed = self._departed.get(key)
            if departed is None:
                continue
            self._settle(key)
            self.tallies.returned(departed[0])
            self._delay[0] += 1
            self._delay[1] += self._now - departed[1]
            self._came_back[key] = departed[3]
            self._came_back.move_to_end(key)
            if len(self._came_back) > self.capacity:
                self._came_back.popitem(last=False)
            refused += not departed[3]
            lost += refused > 0
        self._refused[0] += refused
        return lost, refused

    def _settle(self, key: bytes) -> None:
        """The departure is no longer watched for a return: counted in full if it was not yet."""
        departed = self._departed.pop(key)
        if departed[2]:
            self._full(departed)

    def _full(self, departed: list[Any]) -> None:
        departed[2] = False
        self.tallies.settle(departed[0], departed[1])
        if not departed[3]:  # refused: its return, if any, was expected this often
            self._refused[1] += departed[4]

    def _advance(self, now: float) -> None:
        """Departures out for a whole ramp count in full from now on."""
        self._now = max(self._now, now)
        cutoff = self._now - self.ramp_s
        while self._young and (self._young[0][0] <= cutoff or len(self._young) > self.capacity):
            when, key = self._young.popleft()
            departed = self._departed.get(key)
            if departed is not None and departed[1] == when and departed[2]:
                self._full(departed)

    def _rate(self, tally: int, now: float, prior: float) -> float:
        return self.tallies.rate(tally, max(now, self._now), self.ramp_s, prior, self.weight)

    def overall(self, now: float = 0.0) -> float:
        """Everyone's return rate at `now`, drawn toward 1 while few chunks have left DRAM."""
        return self._rate(EVERYONE, now, 1.0)

    def rate(self, bucket: int, now: float = 0.0) -> float:
        """The bucket's return rate at `now` (the last event's time if later), drawn toward
        its group's while it has little exposure, as that is toward everyone's."""
        return self._rate(bucket, now, self._rate(GROUP0 + group_of(bucket), now, self.overall(now)))

    def refusals(self) -> tuple[float, float]:
        """Refused chunks seen back, and what their rates said of those watched a whole ramp
        or back: how far the rates are to be trusted where they refuse."""
        return self._refused[0], self._refused[1]

    def judged(self, index: int, now: float = 0.0) -> float:
        """The exposure of the departures judged at a rate of bin `index` that needed a write."""
        return self.tallies.exposure(JUDGED + index, max(now, self._now), self.ramp_s)

    def state(self) -> dict[str, Any]:
        """What was learned, per tally: enough for `restore` in a later process."""
        return {"version": STATE_VERSION, "tallies": TALLIES, "returns": list(self.tallies.returns),
                "settled": list(self.tallies.settled), "delay": list(self._delay), "age": list(self._age),
                "chains": list(self._chains), "refused": list(self._refused)}

    def restore(self, state: object) -> None:
        """Take over what a `state()` says was learned; ValueError, and nothing changed, when
        it is not a state of this version and tally layout."""
        counts = _checked_state(state)
        self.tallies.restore(counts["returns"], counts["settled"])
        self._delay, self._age, self._chains = counts["delay"], counts["age"], counts["chains"]
        self._refused = counts["refused"]

    def bucket_of(self, key: bytes, now: float | None = None) -> int:
        """The bucket of the request that last named this chunk (reported, else inferred),
        and whether it came back before; if it was named before or came back and, at `now`,
        has been unnamed LATE times as long as departing chunks were on average, its split's
        late bucket."""
        label = self._label.get(key)
        bucket = (self._guessed.get(key, UNKNOWN) if label is None else label) + \
            (BACK if key in self._came_back else 0)
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
    lengths = {"returns": TALLIES, "settled": TALLIES, "delay": 2, "age": 2, "chains": 2, "refused": 2}
    if not isinstance(state, dict) or set(state) != {"version", "tallies", *lengths}:
        raise ValueError(f"learned rates: a mapping of exactly version, tallies, {', '.join(lengths)}")
    if state["version"] != STATE_VERSION or state["tallies"] != TALLIES:
        raise ValueError(f"learned rates of version {state['version']!r} with {state['tallies']!r} tallies; "
                         f"this kvstore keeps version {STATE_VERSION} with {TALLIES}")
    counts: dict[str, list[float]] = {}
    for name, length in lengths.items():
        values = state[name]
        if not isinstance(values, list) or len(values) != length or not all(
                type(v) in (int, float) and 0 <= v <= MAX_COUNT for v in values):
            raise ValueError(f"learned rates: {name} must be {length} counts from 0 to {MAX_COUNT:g}")
        counts[name] = [float(v) for v in values]
    return counts
