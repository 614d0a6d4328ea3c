"""Scheduler-side decisions: how many prompt tokens to load, and which chunks to save.

SchedulerCore takes vLLM's hooks and makes the decision; the parts it composes each keep
one thing (its docstring names them), in modules of their own beside this one.

Invariants (each holds per request):
- A load covers whole chunks of the leading run present in the store, for every
  tensor-parallel rank, and ends at least one token before the prompt's end: the
  engine must compute one token to produce logits.
- A load never writes a block the engine's own prefix cache already supplied
  (those are marked SKIP): such blocks may be shared with running requests
  (engine_plugin/vllm/core/step_planner.py).
- A chunk is saved once, in the step in which its last token's KV is computed
  (chunked prefill spreads a prompt over steps, decoding fills chunks one token at a
  time), and only if the store did not already hold it when the request arrived.
  Chunks of generated tokens are saved like prompt chunks (`saves="answers"`), so the
  next turn of a conversation (prompt + answer + new message) finds the answer too.
- With a prefetch policy, a request's arrival starts promoting its stored chunks to
  DRAM, and the policy (engine_plugin/vllm/core/prefetch.py) decides whether the scheduler asks
  again later and how many stored chunks to count; never a blocking wait.
- Saves in flight hold requests that would miss them (engine_plugin/vllm/core/save_tracker.py).
- A hybrid model's KV cache groups each have their own keys, block ids and transfers;
  what each group stores, loads and needs for a hit is engine_plugin/vllm/core/groups.py's.
- A request's keys cover what its token ids do not show (its `KeyExtras`: images behind
  placeholder tokens, prompt embeddings), for prompt chunks and for the chunks its
  generated tokens fill; hints carry token ids only, so they name text chunks alone.
- A request handed off by a prefill instance (engine_plugin/vllm/core/handoff.py) is held until the
  chunks its producer named are readable, at most `pd_wait_s`; an instance whose
  role saves nothing (a kv_consumer) plans no saves.
- A request abandoned after a fault (`abandon`) is forgotten and never half-loaded: a
  load planned for it and not yet shipped is given up whole (every block reported
  failed, so the engine recomputes it rather than read blocks never filled).
- A request that ends tells the service how (engine_plugin/vllm/core/chain_reports.py), for its
  next-turn prediction and disk admission.
- The lookup that decides a load protects it (a model with one KV cache group): it leases
  the run the store holds in DRAM for the workers' copy, and the lease goes back once no
  copy can still read it (engine_plugin/vllm/core/leases.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from engine_plugin.vllm.core.chain_reports import ChainReports, Notify
from engine_plugin.vllm.core.groups import KVGeometry
from engine_plugin.vllm.core.handoff import Handoff, HandoffWaits
from engine_plugin.vllm.core.leases import Leases, Released
from engine_plugin.vllm.core.plan import StepPlan
from engine_plugin.vllm.core.prefetch import Lookup, PrefetchPolicy, PrefetchTracker
from engine_plugin.vllm.core.prompt_lookups import TOKENS_ONLY, Keying, PromptLookups
from engine_plugin.vllm.core.request_state import RequestState
from engine_plugin.vllm.core.save_tracker import SaveTracker
from engine_plugin.vllm.core.step_planner import Saves, StepPlanner
from kvstore.format.keys import KVNamespace

__all__ = ["Keying", "Saves", "SchedulerCore", "SchedulerSettings"]


@dataclass(frozen=True)
class SchedulerSettings:
    """The engine-side options the scheduler acts on (engine_plugin/vllm/core/options.py);
    what the model fixes (chunk and block sizes, KV cache groups) is its KVGeometry."""

    load_async: bool = True
    # A hit the lookup leased whole (in DRAM: a copy, no I/O) loads before the forward pass
    # of the step that computes the rest, one engine step sooner than an async load.
    sync_dram_loads: bool = True
    prefetch: PrefetchPolicy | None = None  # None: no promotion, every stored chunk counts at once
    stage_on_arrival: bool = False  # workers have device staging pools
    wait_for_saves_s: float = 5.0
    # What is saved: "answers" (prompt chunks and chunks of generated tokens), "prompts"
    # (prompt chunks only), "none" (plan no saves: a kv_consumer's default).
    saves: Saves = "answers"
    handoff_wait_s: float = 5.0  # longest hold for chunks a prefill instance named
    # Workers whose reports this scheduler hears: 0, one per tensor-parallel rank (vLLM
    # aggregates them); 1 under vLLM's external launcher, where each process schedules
    # for its own worker alone.
    reporting_workers: int = 0


class SchedulerCore:
    """The scheduler side of the connector: each vLLM hook of a request, in the order vLLM
    calls them, over the parts that each keep one thing.

    Parts: `lookups` (keys and what the store holds of them), `saves` (saves in flight and
    the holds they put on requests), `handoffs` (holds for a prefill instance's chunks),
    `prefetch` (the prefetch policy's holds), `leases` (the DRAM leases of decided loads),
    `planner` (the step plan the workers carry out) and `reports` (what the service is told
    when a request ends). This class keeps the requests decided (RequestState, by id) and
    makes the decision that needs every part: how many tokens a request loads, and whether
    its load runs while it waits (async) or before its step's forward pass.

    Invariants:
    - A request is decided by its latest ask: asked again, its earlier decision and lease
      go first; held (saves, handoff, prefetch), it is not decided and its keys are kept.
    - A request is forgotten by every part at once (`on_finished`, `abandon`), and what is
      not known here is never planned.
    - Counters (take_counters) are this core's and every part's, in one report.
    """

    def __init__(self, geometry: KVGeometry, namespaces: Callable[[str], Sequence[KVNamespace]],
                 lookup: Lookup, settings: SchedulerSettings, clock: Callable[[], float] = time.monotonic,
                 notify: Notify | None = None) -> None:
        self.chunk_tokens = geometry.chunk_tokens
        self.settings = settings
        self.lookups = PromptLookups(geometry, namespaces, lookup)
        self.ranks = self.lookups.ranks
        self.counters: Counter[str] = Counter()
        reporting = settings.reporting_workers or self.ranks  # a save or sync load is done once all report it
        self.saves = SaveTracker(reporting, settings.wait_for_saves_s, self.counters, clock)
        self.handoffs = HandoffWaits(settings.handoff_wait_s, self.counters, clock, notify)
        self.prefetch = (PrefetchTracker(settings.prefetch, clock) if settings.prefetch is not None
                         else None)
        self.leases = Leases(reporting)
        self.planner = StepPlanner(geometry, self.ranks, settings.saves, self.saves)
        self.reports = ChainReports(notify, geometry.chunk_tokens, clock)
        self._requests: dict[str, RequestState] = {}

    def on_arrival(self, req_id: str, prompt: Sequence[int], keying: Keying = TOKENS_ONLY) -> None:
        """A request entered the waiting queue: start promoting its stored chunks now,
        long before the scheduler reaches it, and have the workers stage them."""
        if self.prefetch is None and not self.settings.stage_on_arrival:
            return
        keys = self.lookups.keys(prompt, keying)
        self.lookups.keep(req_id, keys)
        residency = self.lookups.residency(keys, prefetch=self.prefetch is not None)
        if self.prefetch is not None:
            self.prefetch.arrived(req_id, residency)
        if self.settings.stage_on_arrival and residency.stored:
            self.planner.stage(req_id, keys, residency.stored)

    def forget_lookups(self) -> None:
        """The namespaces changed (a new generation): keys computed at arrival are stale."""
        self.lookups.clear()

    def hint(self, prompt: Sequence[int], salt: str = "") -> None:
        """Tokens a future request will start with: promote what the store holds of them."""
        self.lookups.residency(self.lookups.keys(prompt, Keying(salt)), prefetch=True)

    def expect(self, prompt: Sequence[int], in_s: float, salt: str = "") -> None:
        """Tokens a request will start with in `in_s` seconds: promoted just before."""
        self.reports.expect(self.lookups.keys(prompt, Keying(salt)), in_s)

    def num_new_matched_tokens(self, req_id: str, prompt: Sequence[int], num_computed: int,
                               keying: Keying = TOKENS_ONLY) -> int | None:
        """Tokens beyond `num_computed` (the engine's own hit) that the store can supply,
        or None: saves of its next chunks are in flight, or the prefetch policy holds
        the request; ask again later."""
        kept = self.lookups.kept(req_id)  # keyed in the namespaces of now too (forget_lookups)
        keys = kept if kept is not None else self.lookups.keys(prompt, keying)
        self._requests.pop(req_id, None)  # asked again: its earlier answer's lease goes
        self.leases.drop(req_id)
        loadable = (len(prompt) - 1) // self.chunk_tokens  # a load may end here, no further
        first = num_computed // self.chunk_tokens  # the engine's own cache holds those before
        residency = self.lookups.residency(keys, prefetch=self.prefetch is not None and kept is None,
                                           cap=loadable, lease_from=first if first < loadable else None)
        held = (self.saves.held(req_id, keys[0], residency.stored)
                or self.handoffs.held(req_id, keys, residency.stored, len(prompt), self.chunk_tokens))
        usable = None if held else residency.stored
        if usable is not None and self.prefetch is not None:
            usable = self.prefetch.decide(req_id, residency, len(prompt))
        if usable is None:  # held: asked again later, its keys kept and its lease let go
            self.lookups.keep(req_id, keys)
            self.leases.release(residency.lease)
            return None
        load_end = min(usable, loadable) * self.chunk_tokens
        namespaces = self.lookups.namespaces(keying.salt)
        request = self._requests[req_id] = RequestState(
            keys, prompt, namespaces, keying.extras, load_end, residency, len(prompt))
        self.leases.hold(req_id, residency.lease)
        request.load_async = self.settings.load_async and not (
            self.settings.sync_dram_loads and request.leased_whole(first, load_end // self.chunk_tokens))
        request.turn_idle = self.reports.planned(keys[0])
        return max(0, load_end - num_computed)

    def expect_handoff(self, req_id: str, handoff: Handoff) -> None:
        """A prefill instance stored this request's prompt chunks: hold it until they
        are readable here (or handoff_wait_s passes)."""
        self.handoffs.expect(req_id, handoff)

    def handoff(self, req_id: str, prompt_tokens: int, host: str | None = None) -> Handoff | None:
        """What a consumer should wait for: the leading prompt chunks this instance
        stored or queued for saving (call before on_finished); None if none."""
        request = self._requests.get(req_id)
        if request is None:
            return None
        chunks = min(request.saved_chunks, prompt_tokens // self.chunk_tokens, len(request.keys[0]))
        return Handoff(chunks, request.keys[0][chunks - 1], host) if chunks else None

    def hit_sources(self, req_id: str, num_external: int) -> dict[str, int]:
        """A hit's tokens by the tier that held them (`RequestState.sources`), for engines' metrics."""
        request = self._requests.get(req_id)
        return {} if request is None else request.sources(num_external, self.chunk_tokens)

    def saves_done(self, save_ids: Iterable[int]) -> None:
        self.saves.done(save_ids)

    def take_counters(self) -> dict[str, int]:
        """Counters since the last call (this core's and its prefetch policy's). Emptied
        in place: the save tracker and the handoff waits count into the same object."""
        counters = Counter(self.counters)
        self.counters.clear()
        if self.prefetch is not None:
            counters.update(self.prefetch.take_counters())
        return dict(counters)

    def on_alloc(self, req_id: str, block_ids: Sequence[int] | Sequence[Sequence[int]],
                 num_external: int) -> None:
        """Blocks are allocated (per group, or one group's list): plan the load of the last
        `num_external` tokens of the hit (StepPlanner.load); an async one keeps its lease
        until the workers report it ended."""
        request = self._requests.get(req_id)
        if request is None:
            return
        if num_external == 0:  # nothing to load: its lease is not needed, its offsets pinned no more
            self.leases.drop(req_id)
            request.found = dataclasses.replace(request.found, lease=0, offsets=())
            return
        request.allocated(block_ids, replace=True)
        written = self.planner.load(req_id, request, num_external)
        if written:
            self.leases.planned(req_id, written, sync=not request.load_async)

    def on_scheduled(self, req_id: str, block_ids: Sequence[int] | Sequence[Sequence[int]] | None,
                     replace: bool, computed_after_step: int) -> None:
        """A request runs this step; chunks it completes are saved after the forward
        (StepPlanner.save)."""
        request = self._requests.get(req_id)
        if request is None:
            return
        if block_ids is not None:
            request.allocated(block_ids, replace)
        self.planner.save(req_id, request, computed_after_step)

    def take_plan(self) -> StepPlan:
        """The plan for this step; the next step starts empty. Its loads' leases go once
        the workers are done with them (Leases.step_done)."""
        plan = self.planner.take()
        self.leases.shipped(plan.step)
        return plan

    def loads_async(self, req_id: str) -> bool:
        """Whether the load decided at the match runs while the request waits (the engine
        is told so): a hit leased whole in DRAM loads in its step (`sync_dram_loads`)."""
        request = self._requests.get(req_id)
        return request.load_async if request is not None else self.settings.load_async

    def step_done(self, loads_ended: Iterable[str], failed: Iterable[str] = (),
                  failed_blocks: Iterable[int] = (), steps: Iterable[int] = ()) -> None:
        """The workers reported: async loads that ended, loads that failed (by request, or
        by block on a model with one KV cache group) and the plans whose sync loads each
        worker carried out (Leases.step_done)."""
        self.leases.step_done(loads_ended, failed, failed_blocks, steps)

    def take_releases(self) -> Released:
        """The leases to tell the service are done with (on the next request to it), read
        (their loads carried out) or not."""
        return self.leases.take()

    def on_finished(self, req_id: str) -> None:
        """Forget the request; tell the service it ended with these chunks (prompt and answer), which
        it brings into DRAM before the next turn is expected (kvstore/service/next_turns.py)."""
        request = self._forget(req_id)
        if request is not None:
            self.reports.ended(*request.ending())

    def abandon(self, req_id: str, blocks: Sequence[Sequence[int]] = ()) -> None:
        """A fault while serving `req_id`: its load in this step's plan is given up whole, or
        `blocks` allocated for a hit never planned are (StepPlan.give_up); then it is
        forgotten (the service is not told it ended: what it kept may be what faulted). A
        load the workers already have still copies: its lease is released read once it ends."""
        if self.planner.give_up(req_id, blocks, self.loads_async(req_id)):
            self.leases.given_up(req_id)
        self._forget(req_id)

    def _forget(self, req_id: str) -> RequestState | None:
        """Forget a request in every part; its lease goes now, or its load's once the
        workers are done with it (Leases.drop)."""
        self.lookups.forget(req_id)
        self.saves.forget(req_id)
        self.handoffs.forget(req_id)
        if self.prefetch is not None:
            self.prefetch.forget(req_id)
        self.leases.drop(req_id)
        return self._requests.pop(req_id, None)
