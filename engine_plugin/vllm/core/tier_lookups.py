"""A secondary tier's lookups: answered on the engine's thread from residency snapshots
the service gives on a thread of this module's own.

An engine that runs its own tiers (vLLM's tiering layer, engine_plugin/vllm/tier.py) asks
a secondary tier about one chunk at a time, on its scheduler thread, and takes "ask again
later" (WAIT) for an answer. So a lookup never waits for the service: the chunks of one
chain (vLLM: a KV cache group) a request asks about in one step, in ascending order, are
one run (a full-attention group's prefix scan); a chunk asked before the one asked last
(a sliding-window group is scanned from the prompt's end back, where a follow-up's new
chunks are not stored yet) starts a run of its own, so each is found or not for itself.
When the step ends (`flush`) each run is one `residency` request on the lookup thread, with `prefetch` when
the policy has one (the service starts promoting the run's disk part to DRAM). Until its
answer is in, its chunks WAIT. The answer is a snapshot: the leading part of the run the
store holds (the first absent chunk ends it: the chunks after it miss), how much of that
is in DRAM, and whether the service still promotes it. The connector's prefetch policy
(engine_plugin/vllm/core/prefetch.py) decides from it how many chunks load now: `wait` holds the
request (WAIT, each step's answer asked again) while the promotion runs, at most its
budget, then every stored chunk is a HIT; `best_effort` takes what is in DRAM; no policy
takes every stored chunk at once (the load reads disk itself).

Invariants: a chunk that once missed for a request misses for it until it ends (a load
that found a HIT gone must not be asked for again and again); a run whose answer has not
come within `deadline_s` misses (a hung service holds no request longer); a request's
state goes when it ends (`forget`). Every lookup runs on the one lookup thread, over one
connection (`later`, a ServiceLane of its own: best effort work goes on another), and a
failure is a miss, never an exception.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

from connectors.link import ServiceLink
from engine_plugin.vllm.core.prefetch import PrefetchPolicy, PrefetchTracker, Residency
from engine_plugin.vllm.core.service_lane import ServiceLane
from kvstore.service.client import StoreClient

log = logging.getLogger("kvstore.tier")
T = TypeVar("T")
NOTHING = Residency(0, 0)


class Verdict(Enum):
    HIT = "hit"
    MISS = "miss"
    WAIT = "wait"


@dataclass
class _Run:
    """Chunks one request asked about in one step, in the order asked."""

    name: str  # the prefetch tracker's name for it
    keys: list[bytes] = field(default_factory=list)
    tokens: int = 0  # the furthest token position its chunks end at (the policy's prompt length)
    asked_at: float | None = None
    answer: Future[Residency] | None = None
    decided: Future[Residency] | None = None  # the answer the policy last saw
    loadable: int | None = None  # leading chunks that HIT, once decided


@dataclass
class _Request:
    runs: list[_Run] = field(default_factory=list)
    where: dict[bytes, tuple[_Run, int]] = field(default_factory=dict)
    open: dict[int, _Run] = field(default_factory=dict)  # this step's last run, by chain, not yet asked
    missed: set[bytes] = field(default_factory=set)


class TierLookups:
    def __init__(self, link: ServiceLink, policy: PrefetchPolicy | None, deadline_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.prefetch = policy is not None
        self.tracker = PrefetchTracker(policy or PrefetchPolicy(), clock)
        self.deadline_s = deadline_s
        self._clock = clock
        self._asks = ServiceLane(link, "kvstore-tier-lookup")  # lookups alone: no best effort work
        self._requests: dict[str, _Request] = {}

    def verdict(self, req_id: str, key: bytes, tokens: int, chain: int = 0) -> Verdict:
        """Whether chunk `key` (ending at token `tokens` of the request, in its `chain`)
        loads now."""
        request = self._requests.setdefault(req_id, _Request())
        if key in request.missed:
            return Verdict.MISS
        known = request.where.get(key)
        if known is None:
            run = request.open.get(chain)
            if run is None or (run.keys and tokens <= run.tokens):  # asked backwards: its own run
                run = request.open[chain] = _Run(f"{req_id}#{len(request.runs)}")
                request.runs.append(run)
            request.where[key] = (run, len(run.keys))
            run.keys.append(key)
            run.tokens = max(run.tokens, tokens)
            return Verdict.WAIT
        run, index = known
        loadable = self._decide(run)
        if loadable is None:
            return Verdict.WAIT
        return Verdict.HIT if index < loadable else Verdict.MISS

    def _decide(self, run: _Run) -> int | None:
        """The run's loadable chunks, or None while its answer (or its promotion) is awaited."""
        if run.loadable is not None:
            return run.loadable
        if run.answer is None:
            return None
        if not run.answer.done():  # a first answer, or a held run's next one
            assert run.asked_at is not None
            if self._clock() - run.asked_at > self.deadline_s:
                run.loadable = 0
            return run.loadable
        if run.answer is not run.decided:
            run.decided, seen = run.answer, run.answer.result()
            run.loadable = self.tracker.decide(run.name, seen, run.tokens) if self.prefetch else seen.stored
        return run.loadable

    @staticmethod
    def _held(run: _Run) -> bool:
        """The policy holds the run while the service promotes it: asked again each step."""
        return run.loadable is None and run.answer is not None and run.answer is run.decided

    def flush(self) -> None:
        """The step ended: this step's runs are asked, and runs still held by their
        promotion are asked again."""
        for request in self._requests.values():
            for run in request.runs:
                if run.answer is None:  # opened this step
                    self._ask(run, self.prefetch)
                elif self._held(run):
                    self._ask(run, False)
            request.open.clear()

    def missed(self, req_id: str, keys: Iterable[bytes]) -> None:
        """These chunks failed to load: they miss for this request from now on."""
        request = self._requests.get(req_id)
        if request is not None:
            request.missed.update(keys)

    def forget(self, req_id: str) -> None:
        request = self._requests.pop(req_id, None)
        for run in request.runs if request is not None else ():
            self.tracker.forget(run.name)

    def forget_all(self) -> None:
        """Every request's lookups (their keys are not the tier's any more: a new generation)."""
        for req_id in list(self._requests):
            self.forget(req_id)

    def pending(self) -> bool:
        """Whether an answer is on its way, or a run is held by its promotion."""
        return any(run.answer is not None and (not run.answer.done() or self._held(run))
                   for request in self._requests.values() for run in request.runs)

    def later(self, call: Callable[[StoreClient], T]) -> Future[T | None]:
        """`call(client)` on the lookup thread and connection; None where the service is
        unavailable or the call failed (logged, the connection dropped)."""
        return self._asks.submit(call)

    def _ask(self, run: _Run, prefetch: bool) -> None:
        """Ask the service about the run (its deadline runs from now)."""
        answer: Future[Residency] = Future()

        def answered(asked: Future[tuple[int, int, bool] | None]) -> None:
            found = None if asked.cancelled() or asked.exception() is not None else asked.result()
            answer.set_result(NOTHING if found is None else Residency(*found))

        keys = list(run.keys)
        run.asked_at, run.answer = self._clock(), answer
        self.later(lambda client: client.residency(keys, prefetch)).add_done_callback(answered)

    def close(self) -> None:
        """Stop the lookup thread once what was asked of it is done (each call ends within
        its deadline; after a failure the rest find the service unavailable at once), then
        the link."""
        self._asks.close()
