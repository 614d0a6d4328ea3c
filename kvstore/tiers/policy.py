"""Where chunks go and when they move between tiers: the store's policy, in one place.

The store (store/tiered.py) moves bytes; the trace replay (bench/replay.py) moves none; both
ask this object the same questions, so a replay's hit ratios are the store's:
- a new chunk goes to the top tier (DRAM) if it has a slot, else straight down;
- a victim of the top tier is demoted to the tier below unless that tier holds it
  already or does not admit it (then it is simply evicted: `admission_refused`);
- the disk admits a chunk as the `admission` policy says (admission.py: `all`,
  `second-touch`, `tinylfu`, `predicted`), from the chains requests stored or read
  (`seen`); with write_through every chunk goes down as soon as it is stored and is
  never refused (a PD producer in a cluster relies on it: connectors/handoff.py);
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

Switching a policy at runtime (`set_admission`, `set_eviction` with SlotTable.set_eviction:
StoreParts.switch_policy (store.parts.switch_policy), which `kvstore serve` calls on SIGHUP) keeps every
chunk a tier holds: admission only decides future writes, and the new eviction order is
built from the chunks already published.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from kvstore.tiers.admission import TRACKED_KEYS, Admission, make_admission
from kvstore.tiers.eviction import CostAware, Eviction, PrefixLRU
from kvstore.tiers.slots import Fate

EVICTIONS = ("lru", "cost")
DEFAULT_ADMISSION = "all"
CROSSOVER_TOKENS = 32768
_DEPTHS = 4 * TRACKED_KEYS  # chunks whose depth and family are remembered


@dataclass
class TierPolicy:
    promote_on_hit: bool = True
    write_through: bool = False
    admission: str = DEFAULT_ADMISSION
    disk_min_seen: int = 2  # sightings `second-touch`, `tinylfu` and `predicted` ask for
    eviction: str = "lru"
    chunk_tokens: int = 256
    crossover_tokens: int = CROSSOVER_TOKENS

    # guards the admission state and the chains; not a setting, so not a constructor parameter
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.set_eviction(self.eviction)
        self._admission: Admission = make_admission(self.admission, self.disk_min_seen)
        self._chains: OrderedDict[bytes, tuple[bytes, int]] = OrderedDict()  # key -> (family, depth)

    def set_admission(self, name: str, min_seen: int | None = None) -> None:
        """Switch the disk admission policy (and its sightings) now; what the disk holds stays."""
        admission = make_admission(name, self.disk_min_seen if min_seen is None else min_seen)
        with self._lock:
            self.admission, self._admission = name, admission
            self.disk_min_seen = self.disk_min_seen if min_seen is None else min_seen

    def set_eviction(self, name: str) -> None:
        """Name the eviction order make_eviction builds (the tables switch with
        SlotTable.set_eviction, keeping what they hold)."""
        if name not in EVICTIONS:
            raise ValueError(f"eviction {name!r}: one of {', '.join(EVICTIONS)}")
        self.eviction = name

    def make_eviction(self) -> Eviction:
        """A tier's eviction order as `eviction` names it (SlotTable.set_eviction takes it)."""
        return CostAware(self.chunk_cost) if self.eviction == "cost" else PrefixLRU()

    def seen(self, keys: list[bytes], parent: bytes | None = None) -> None:
        """Requests stored or read these chunks of one chain, `parent` before the first."""
        if not keys or (self.admission == "all" and self.eviction != "cost"):
            return  # nothing to remember (the default): no lock on every put and get
        with self._lock:
            if self.eviction != "cost" and self.admission != "predicted":  # no depth or family asked
                self._admission.see(keys, keys[0])
                return
            above = None if parent is None else self._chains.get(parent)
            first = self._chains.get(keys[0])  # a read of a chain's later part: known already
            if above is not None:
                family, depth = above
            elif first is not None:
                family, depth = first[0], first[1] - 1
            else:
                family, depth = keys[0], -1
            for key in keys:
                depth += 1
                self._chains[key] = (family, depth)
                self._chains.move_to_end(key)
            while len(self._chains) > _DEPTHS:
                self._chains.popitem(last=False)
            self._admission.see(keys, family)

    def admits(self, key: bytes) -> bool:
        """Whether the disk takes this chunk now (always, writing through or under `all`:
        without the lock, as a victim's fate is asked under the DRAM table's)."""
        if self.write_through or self.admission == "all":
            return True
        with self._lock:
            return self._admission.admit(key)

    def depth(self, key: bytes, parent: bytes | None = None) -> int:
        """The chunk's position in its chain (0: the first), as far as it is remembered."""
        with self._lock:
            known = self._chains.get(key)
            if known is None and parent is not None:
                above = self._chains.get(parent)
                return 0 if above is None else above[1] + 1
            return 0 if known is None else known[1]

    def chunk_cost(self, key: bytes, parent: bytes | None = None) -> float:
        """What recomputing this chunk costs, in units of one chunk's linear work."""
        return self.depth_cost(self.depth(key, parent))

    def depth_cost(self, depth: int) -> float:
        return 1.0 + (depth + 0.5) * self.chunk_tokens / self.crossover_tokens

    def victim_fate(self, key: bytes, below_has_it: bool, promotion: bool) -> Fate:
        """A DRAM victim's fate (asked under the DRAM table's lock): dropped when the tier
        below holds it or does not admit it; else written down first (DEMOTE), except for a
        get's promotion, which never waits on a write and passes it over (SKIP)."""
        if below_has_it or not self.admits(key):
            return Fate.EVICT
        return Fate.SKIP if promotion else Fate.DEMOTE
