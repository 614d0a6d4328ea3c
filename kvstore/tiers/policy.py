"""Where chunks go and when they move between tiers: the store's policy, in one place.

The store (store/tiered.py) moves bytes; the trace replay (bench/replay.py) moves none; both
ask this object the same questions, so a replay's hit ratios are the store's:
- a new chunk goes to the top tier (DRAM) if it has a slot, else straight down;
- a victim of the top tier is demoted to the tier below unless that tier holds it
  already or does not admit it (then it is simply evicted);
- the disk admits a chunk once it has been seen `disk_min_seen` times (stored by a
  request that computed it, or read); with write_through, a chunk also goes down as
  soon as it is stored, not only when evicted;
- a lower-tier hit is promoted to the top (promote_on_hit).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvstore.tiers.admission import AdmissionFilter
from kvstore.tiers.slots import Fate


@dataclass
class TierPolicy:
    promote_on_hit: bool = True
    write_through: bool = False
    disk_min_seen: int = 1

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.admission = AdmissionFilter(self.disk_min_seen)

    def seen(self, keys: list[bytes]) -> None:
        """Requests stored or read these chunks (counts toward disk admission)."""
        if self.disk_min_seen > 1:
            with self._lock:
                for key in keys:
                    self.admission.see(key)

    def admits(self, key: bytes) -> bool:
        """Whether the disk takes this chunk now."""
        if self.disk_min_seen <= 1:
            return True
        with self._lock:
            return self.admission.admit(key)

    def victim_fate(self, key: bytes, below_has_it: bool, promotion: bool) -> Fate:
        """A DRAM victim's fate (asked under the DRAM table's lock): dropped when the tier
        below holds it or does not admit it; else written down first (DEMOTE), except for a
        get's promotion, which never waits on a write and passes it over (SKIP)."""
        if below_has_it or not self.admits(key):
            return Fate.EVICT
        return Fate.SKIP if promotion else Fate.DEMOTE
