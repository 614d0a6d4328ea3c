"""Where chunks go and when they move between tiers: the store's policy, in one place.

The store (store/tiered.py) moves bytes; the trace replay (bench/sim/replay.py) moves none; both
ask this object the same questions, so a replay's hit ratios are the store's while its DRAM
cleaner keeps up with the disk (a replay has no disk speed; datapath/cleaner.py):
- a new chunk goes to the top tier (DRAM) if it has a slot, else straight down;
- a victim of the top tier is demoted to the tier below unless that tier holds it
  already or does not admit it (then it is simply evicted: `admission_refused`);
- the disk admits a chunk as the `admission` policy says (admission.py: `all`,
  `second-touch`, `tinylfu`, `predicted`, `learned`), from the chains requests stored or
  read (`seen`; reads are hits, which `learned`'s loss budget is a share of), how
  requests ended (`finished`) and what left DRAM (`left_dram`, told by the DRAM table's
  events); `admits` only asks, so a victim scan may ask it of many chunks; with
  write_through every chunk goes down as soon as it is stored and is never refused (a
  PD producer in a cluster relies on it: engine_plugin/vllm/core/handoff.py);
- with a write budget (write_budget.py) the disk also refuses chunks whose return rate is
  under the budget's threshold, and every disk write is claimed from its allowance first
  (`claim_writes`, `settle_writes`): the budget is never exceeded;
- each tier evicts by `eviction` (eviction.py): `lru`, or `cost`, whose value of a
  chunk is `chunk_cost` (below) on top of a clock that makes recency its chance of reuse;
- a lower-tier hit is promoted to the top (promote_on_hit).

The cost model: recomputing a chunk of `chunk_tokens` tokens whose first token sits at
position p costs its linear work (2 x parameters FLOPs a token, the same for every
chunk) plus attention over everything before it (4 x layers x hidden x p' FLOPs for a
token at position p', growing with depth). In units of one chunk's linear work:
    cost(depth) = 1 + (depth + 0.5) x chunk_tokens / crossover_tokens
where `crossover_tokens` is the context length at which a token's attention FLOPs equal
its linear FLOPs (Llama 3.1 8B: 2 x 8.0e9 / (4 x 32 x 4096) = about 30,500; 32,768 here).
A chunk's depth (and its family, for `predicted`) is learned from the chains seen, in a
bounded memory kept only while `cost` or `predicted` asks for it; an unknown depth is 0.
A family is a chain from the last chunk where chains sharing their prefix diverged: every
request may start with one system prompt, and each conversation is still a family of its
own (a chunk with two different children seen is a branch; the child starts a family).

Switching a policy at runtime (`set_admission`, `set_budget`, `set_eviction` with SlotTable.set_eviction:
StoreParts.reload_policy (StoreAdmin.reload_policy), which `kvstore serve` calls on SIGHUP) keeps every
chunk a tier holds: admission only decides future writes, and the new eviction order is
built from the chunks already published.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.tiers.admission import TRACKED_KEYS, Admission, Learned, Tuning, make_admission
from kvstore.tiers.eviction import CostAware, Eviction, PrefixLRU
from kvstore.tiers.return_rates import RequestEnd
from kvstore.tiers.slots import Fate
from kvstore.tiers.write_budget import WriteBudget

EVICTIONS = ("lru", "cost")
DEFAULT_ADMISSION = "all"
CROSSOVER_TOKENS = 32768
_DEPTHS = 4 * TRACKED_KEYS  # chunks whose depth and family are remembered
# however large the tiers: the most keys `learned` remembers a kind of (about 1,250 bytes for each
# of its labels, reported and inferred, last-named times, departures, returns and queue entry:
# 624 MiB, tracemalloc), and tinylfu's counters a row (16 MiB)
_MOST_LEARNED, _MOST_COUNTERS = 1 << 19, 1 << 22
_BRANCHED = b""  # a chunk seen with two different children


class ChainMemory:
    """Each chunk's depth in its chain and its prefix family, from the chains seen (at most
    `capacity` chunks, the least recently seen forgotten first). A chunk seen with two
    different children is a branch; a family starts at the child of the last branch above
    it, or at the chain's first chunk. Not thread-safe: TierPolicy calls it under its lock."""

    def __init__(self, capacity: int = _DEPTHS) -> None:
        self.capacity = capacity
        self._chains: OrderedDict[bytes, list[Any]] = OrderedDict()  # key -> [family, depth, child]

    def record(self, keys: list[bytes], parent: bytes | None) -> bytes:
        """These chunks of one chain, `parent` before the first, were seen: their family."""
        above = None if parent is None else self._chains.get(parent)
        first = self._chains.get(keys[0])  # a read of a chain's later part: known already
        if above is not None:
            family, depth = above[0], above[1]
        elif first is not None:
            family, depth = first[0], first[1] - 1
        else:
            family, depth = keys[0], -1
        for before, key in zip([parent, *keys[:-1]], keys, strict=True):
            depth += 1
            if self._branches(before, key):
                family = key
            known = self._chains.get(key)
            self._chains[key] = [family, depth, None if known is None else known[2]]
            self._chains.move_to_end(key)
        while len(self._chains) > self.capacity:
            self._chains.popitem(last=False)
        return family

    def _branches(self, parent: bytes | None, key: bytes) -> bool:
        """Whether `parent` now has another child than `key` too."""
        known = None if parent is None else self._chains.get(parent)
        if known is None:
            return False
        if known[2] is None:
            known[2] = key
        elif known[2] != key:
            known[2] = _BRANCHED
        return known[2] == _BRANCHED

    def depth(self, key: bytes, parent: bytes | None) -> int:
        """The chunk's position in its chain (0: the first), as far as it is remembered."""
        known = self._chains.get(key)
        if known is None and parent is not None:
            above = self._chains.get(parent)
            return 0 if above is None else above[1] + 1
        return 0 if known is None else known[1]


@dataclass
class TierPolicy:
    promote_on_hit: bool = True
    write_through: bool = False
    admission: str = DEFAULT_ADMISSION
    disk_min_seen: int = 2  # sightings `second-touch`, `tinylfu` and `predicted` ask for
    tuning: Tuning = field(default_factory=Tuning)  # `learned`'s least threshold and loss budget
    eviction: str = "lru"
    chunk_tokens: int = 256
    crossover_tokens: int = field(default=CROSSOVER_TOKENS, init=False)
    clock: Callable[[], float] = field(default=time.monotonic, init=False, repr=False, compare=False)

    # guards the admission state and the chains; not a setting, so not a constructor parameter
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.set_eviction(self.eviction)
        self._capacity = (TRACKED_KEYS, TRACKED_KEYS)  # (learned's keys, tinylfu's counters a row)
        self._budget: WriteBudget | None = None
        self._admission: Admission = self._make(self.admission, self.disk_min_seen)
        self._chains = ChainMemory()

    def _make(self, name: str, min_seen: int) -> Admission:
        capacity = {"learned": self._capacity[0], "tinylfu": self._capacity[1]}.get(name, TRACKED_KEYS)
        admission = make_admission(name, min_seen, capacity)
        if isinstance(admission, Learned):
            admission.clock = lambda: self.clock()  # the clock a replay sets later, too
            admission.tune(self.tuning)
        return admission

    def set_capacity(self, dram_chunks: int, stored_chunks: int) -> None:
        """Size what admission remembers from the tiers (before any traffic: the policy is
        made anew): `learned` a label for every chunk DRAM holds (and as many departures),
        `tinylfu` a counter a row for every chunk the tiers hold; at least TRACKED_KEYS, at
        most _MOST_LEARNED and _MOST_COUNTERS."""
        self._capacity = (min(_MOST_LEARNED, max(TRACKED_KEYS, dram_chunks)),
                          min(_MOST_COUNTERS, max(TRACKED_KEYS, stored_chunks)))
        admission = self._make(self.admission, self.disk_min_seen)
        with self._lock:
            self._admission = admission

    def set_admission(self, name: str, min_seen: int | None = None, tuning: Tuning | None = None) -> None:
        """Switch the disk admission policy (its sightings, `learned`'s tuning; None: as they
        are) now; what the disk holds stays, and so does what `learned` has learned when only
        its tuning changes."""
        min_seen = self.disk_min_seen if min_seen is None else min_seen
        self.tuning = self.tuning if tuning is None else tuning
        with self._lock:
            if isinstance(self._admission, Learned) and name == self.admission:
                self._admission.tune(self.tuning)
                return
        admission = self._make(name, min_seen)
        with self._lock:
            self.admission, self._admission, self.disk_min_seen = name, admission, min_seen

    def use_admission(self, admission: Admission) -> None:
        """Admit by a policy made elsewhere (the replay's clairvoyant bound, bench/sim/replay.py)."""
        with self._lock:
            self.admission, self._admission = admission.name, admission

    def set_budget(self, bytes_per_day: int | None, write_bytes: int = 1) -> None:
        """Cap the disk's writes at `bytes_per_day` (None: no cap), each write costing
        `write_bytes`. A new budget starts with the old one's allowance left, if smaller."""
        with self._lock:
            old, now = self._budget, self.clock()
            self._budget = None if bytes_per_day is None else WriteBudget(bytes_per_day, write_bytes, now)
            if old is not None and self._budget is not None:
                self._budget.carry(old.left(now), now)

    def set_eviction(self, name: str) -> None:
        """Name the eviction order make_eviction builds (the tables switch with
        SlotTable.set_eviction, keeping what they hold)."""
        if name not in EVICTIONS:
            raise ValueError(f"eviction {name!r}: one of {', '.join(EVICTIONS)}")
        self.eviction = name

    def make_eviction(self) -> Eviction:
        """A tier's eviction order as `eviction` names it (SlotTable.set_eviction takes it)."""
        return CostAware(self.chunk_cost) if self.eviction == "cost" else PrefixLRU()

    def seen(self, keys: list[bytes], parent: bytes | None = None, read: bool = False) -> None:
        """A request stored (`read`: read from the store, hits) these chunks of one chain,
        `parent` before the first."""
        if not keys or (self.admission == "all" and self.eviction != "cost"):
            return  # nothing to remember (the default): no lock on every put and get
        with self._lock:
            asked = self.eviction == "cost" or self.admission == "predicted"  # a depth or a family
            family = self._chains.record(keys, parent) if asked else keys[0]
            admission = self._admission
            if not isinstance(admission, Learned):
                admission.see(keys, family)
            elif read:
                admission.served(keys)
            else:
                admission.stored(keys, parent)

    def finished(self, keys: Sequence[bytes], end: RequestEnd) -> None:
        """A request that named these chunks ended so (what `learned` learns from)."""
        if keys and self.admission == "learned":
            with self._lock:
                self._admission.finished(keys, end)

    def learned_state(self, restore: object = None) -> dict[str, Any] | None:
        """What `learned` admission has learned (ReturnRates.state), None under another
        policy; `restore` (an earlier process's) is taken over first: ValueError if it does
        not check, or if admission is not `learned`."""
        with self._lock:
            admission = self._admission
            if restore is not None:
                if not isinstance(admission, Learned):
                    raise ValueError(f"disk admission is {self.admission}, not learned")
                admission.rates.restore(restore)
            return admission.rates.state() if isinstance(admission, Learned) else None

    def left_dram(self, key: bytes, on_disk: bool) -> str | None:
        """The DRAM table's event: this chunk left DRAM (`on_disk`: its disk copy is there,
        written now or before). Without one it was refused: why (`refusal`) is returned, and it
        counts among the chunks the budget's threshold weighs. None: not refused."""
        if self.admission == "all" and self._budget is None:
            return None  # nothing refused, nothing learned: no lock on every eviction
        reason = None if on_disk or self.write_through else self.refusal(key)
        with self._lock:
            if self._budget is not None and not on_disk:
                self._budget.offered(self._admission.rate_of(key), self.clock())
            self._admission.left(key, on_disk)
        return reason

    def admits(self, key: bytes) -> bool:
        """Whether the disk takes this chunk now (always, writing through or under `all`
        without a budget: without the lock, as a victim's fate is asked under the DRAM
        table's). Changes nothing, however often asked."""
        if self.write_through or (self.admission == "all" and self._budget is None):
            return True
        return self.refusal(key) is None

    def refusal(self, key: bytes) -> str | None:
        """Why the disk refuses this chunk now: `policy` (its admission), `budget` (the write
        budget's threshold, or no allowance left), or None: it admits it."""
        with self._lock:
            if not self._admission.admit(key):
                return "policy"
            budget = self._budget
            if budget is None:
                return None
            now = self.clock()
            if not budget.room(now) or self._admission.rate_of(key) < budget.threshold(now):
                return "budget"
            return None

    def claim_writes(self, chunks: int) -> int:
        """How many of `chunks` disk writes the budget lets the caller issue now (charged at
        once; settle_writes gives back what did not land)."""
        if self._budget is None:
            return chunks
        with self._lock:
            return self._budget.claim(chunks, self.clock()) if self._budget is not None else chunks

    def settle_writes(self, claimed: int, landed: Sequence[bytes]) -> None:
        """Of `claimed` disk writes, these chunks landed: the rest is given back to the budget,
        and what was written counts among the chunks its threshold weighs."""
        if self._budget is None:
            return
        with self._lock:
            budget, now = self._budget, self.clock()
            if budget is not None:
                budget.refund(claimed - len(landed), now)
                for key in landed:
                    budget.offered(self._admission.rate_of(key), now)

    def describe(self) -> dict[str, Any]:
        """The admission policy and its budget as `kvstore info` shows them."""
        with self._lock:
            info: dict[str, Any] = {"policy": self.admission}
            if isinstance(self._admission, Learned):
                info.update(self._admission.describe())
            if self._budget is not None:
                info.update(self._budget.describe(self.clock()))
            return info

    def depth(self, key: bytes, parent: bytes | None = None) -> int:
        """The chunk's position in its chain (0: the first), as far as it is remembered."""
        with self._lock:
            return self._chains.depth(key, parent)

    def chunk_cost(self, key: bytes, parent: bytes | None = None) -> float:
        """What recomputing this chunk costs, in units of one chunk's linear work."""
        return self.depth_cost(self.depth(key, parent))

    def depth_cost(self, depth: int) -> float:
        return 1.0 + (depth + 0.5) * self.chunk_tokens / self.crossover_tokens

    def victim_fate(self, key: bytes, settled: bool, passes_over: bool) -> Fate:
        """A DRAM victim's fate (asked under the DRAM table's lock): dropped when nothing is
        to be written for it (`settled`: the tier below holds it, or has no device to take
        it) or the disk does not admit it; else written down first (DEMOTE), except where the
        caller never waits on a write (`passes_over`: a get's promotion, a put beside the
        DRAM cleaner), which passes it over (SKIP)."""
        if settled or not self.admits(key):
            return Fate.EVICT
        return Fate.SKIP if passes_over else Fate.DEMOTE
