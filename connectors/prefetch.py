"""Prefetch policies: how long a request whose chunks sit on disk waits for the
service to promote them to DRAM, and how timely that promotion was.

The scheduler never blocks on I/O. Waiting means answering "ask again later" (vLLM:
None from get_num_new_matched_tokens): the request stays queued, holding no KV blocks,
while the promotion that its arrival started runs and other requests are scheduled.
  best_effort  count only the chunks in DRAM now; the rest is recomputed this time
  wait         hold the request while its promotion runs (at most max_wait_s), then load
               every stored chunk (what did not reach DRAM is read from disk)
  timeout      hold it at most timeout_s_per_1k_tokens x prompt length / 1000 (a budget
               that grows with the prefill it saves), then load what is in DRAM
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

from pydantic import Field, ValidationError

from kvstore.config.schema import Schema, choice, config_error, seconds

POLICIES = ("best_effort", "wait", "timeout")


@dataclass(frozen=True)
class Residency:
    """One prompt's chunks across every tensor-parallel rank: a chunk counts only where
    every rank's copy is (the service answers for all ranks in one snapshot). A lookup that
    asked for a lease also holds the DRAM run pinned for the workers: `lease` (0: none) and
    `offsets[rank][i]`, chunk i's payload in the shared tier (-1: not pinned)."""

    stored: int  # leading chunks present in any tier
    resident: int  # leading chunks already in DRAM
    pending: bool = False  # a promotion of this run is queued or running
    lease: int = 0
    offsets: tuple[tuple[int, ...], ...] = ()


class Lookup(Protocol):
    """What the store holds of one prompt (keys per rank), across ranks; with `lease_from`, its
    DRAM run from that chunk on pinned for the workers until the lease is released."""

    def __call__(self, keys: list[list[bytes]], prefetch: bool,
                 lease_from: int | None = None) -> Residency: ...


class PrefetchPolicy(Schema):
    """How long a request waits for its prefetch; its keys are the engine-side
    `prefetch_*` options (connectors/options.py)."""

    name: Annotated[str, choice(*POLICIES)] = Field(
        "wait", alias="prefetch_policy",
        description="`wait`: hold the request (vLLM: \"ask again later\", no KV blocks taken) while its "
                    "promotion runs; `timeout`: the same up to a budget per prompt token, then recompute "
                    "what is not in DRAM; `best_effort`: never hold it. See [prefetch.md](prefetch.md)")
    max_wait_s: Annotated[float, seconds(zero=True)] = Field(
        10.0, alias="prefetch_max_wait_s", description="the longest any policy holds a request")
    timeout_s_per_1k_tokens: Annotated[float, seconds(zero=True)] = Field(
        0.05, alias="prefetch_timeout_s_per_1k_tokens",
        description="the `timeout` policy's budget per 1,000 prompt tokens")

    def __init__(self, name: str | None = None, /, **values: Any) -> None:
        """PrefetchPolicy("timeout", max_wait_s=5): by field name (or key), `name` also
        positionally; a bad value is a ConfigError naming the key."""
        if name is not None:
            values["name"] = name
        keys = {field: info.alias for field, info in type(self).model_fields.items() if info.alias}
        values = {keys.get(key, key): value for key, value in values.items()}
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise config_error(exc, values) from None

    def budget_s(self, prompt_tokens: int) -> float:
        if self.name == "wait":
            return self.max_wait_s
        if self.name == "timeout":
            return min(self.max_wait_s, self.timeout_s_per_1k_tokens * prompt_tokens / 1000)
        return 0.0


@dataclass
class _Tracked:
    disk_chunks: int  # stored but not in DRAM when the request was first seen
    resident_at_arrival: int
    first_ask: float | None = None


class PrefetchTracker:
    """Per-request decisions and timeliness counters (reset by take_counters):
    prefetch.requests / disk_chunks / resident_chunks: requests that had chunks on disk
    at arrival, those chunks, and how many of them were in DRAM when admitted
    (resident_fraction = resident_chunks / disk_chunks); prefetch.ready_requests (all
    there at the first ask) and prefetch.late_requests with prefetch.late_ms (how long
    they were held, or would have needed to be)."""

    def __init__(self, policy: PrefetchPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self._tracked: dict[str, _Tracked] = {}
        self._admitted: set[str] = set()  # counted once, even if preempted and asked again
        self.counters: Counter[str] = Counter()

    def arrived(self, req_id: str, residency: Residency) -> None:
        self._tracked.setdefault(req_id, _Tracked(residency.stored - residency.resident,
                                                  residency.resident))

    def decide(self, req_id: str, residency: Residency, prompt_tokens: int) -> int | None:
        """Chunks to load now, or None: ask again later."""
        self.arrived(req_id, residency)
        tracked = self._tracked[req_id]
        now = self._clock()
        if tracked.first_ask is None:
            tracked.first_ask = now
        waited = now - tracked.first_ask
        if (residency.resident < residency.stored and residency.pending
                and waited < self.policy.budget_s(prompt_tokens)):
            return None
        if req_id not in self._admitted:
            self._record(tracked, residency, waited)
            self._admitted.add(req_id)
        del self._tracked[req_id]
        return residency.stored if self.policy.name == "wait" else residency.resident

    def forget(self, req_id: str) -> None:
        self._tracked.pop(req_id, None)
        self._admitted.discard(req_id)

    def _record(self, tracked: _Tracked, residency: Residency, waited: float) -> None:
        if tracked.disk_chunks <= 0:
            return
        ready = min(max(residency.resident - tracked.resident_at_arrival, 0), tracked.disk_chunks)
        self.counters["prefetch.requests"] += 1
        self.counters["prefetch.disk_chunks"] += tracked.disk_chunks
        self.counters["prefetch.resident_chunks"] += ready
        if ready == tracked.disk_chunks and waited == 0:
            self.counters["prefetch.ready_requests"] += 1
        else:
            self.counters["prefetch.late_requests"] += 1
            self.counters["prefetch.late_ms"] += round(waited * 1000)

    def take_counters(self) -> dict[str, int]:
        counters, self.counters = dict(self.counters), Counter()
        return counters
