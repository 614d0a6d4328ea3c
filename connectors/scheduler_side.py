"""Scheduler-side decisions: how many prompt tokens to load, and which chunks to save.

Invariants (each holds per request):
- A load covers whole chunks of the leading run present in the store, for every
  tensor-parallel rank, and ends at least one token before the prompt's end: the
  engine must compute one token to produce logits.
- A load never writes a block the engine's own prefix cache already supplied
  (those are marked SKIP): such blocks may be shared with running requests.
- A chunk is saved once, in the step in which its last token is computed
  (chunked prefill spreads a prompt over steps), and only if the store did not
  already hold it when the request arrived. Only prompt tokens are saved.
- With a prefetch policy, a request's arrival starts promoting its stored chunks to
  DRAM, and the policy (connectors/prefetch.py) decides whether the scheduler asks
  again later and how many stored chunks to count; never a blocking wait.
- A save is in flight from the step that plans it until every worker reports it done
  (stored, or given up). A request whose next chunk after the stored run is in flight
  is held ("ask again later") until it lands, at most `wait_for_saves_s`: a follow-up
  sent the moment its predecessor's reply arrives still finds that prompt's chunks.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from connectors.plan import SKIP, Stage, StepPlan, Transfer
from connectors.prefetch import PrefetchPolicy, PrefetchTracker, Residency
from kvstore.format.keys import KVNamespace, chunk_keys

# (keys of one rank, start a promotion to DRAM?) -> what the store holds of them
Lookup = Callable[[list[list[bytes]], bool], Residency]  # keys per rank -> across ranks


@dataclass
class _Request:
    keys: list[list[bytes]]  # [rank][chunk] for every full prompt chunk
    num_prompt_tokens: int
    load_end: int  # token where a load from the store would end
    saved_chunks: int  # chunks [0, saved_chunks) are stored or queued for saving
    block_ids: list[int] = field(default_factory=list)


@dataclass
class _Saving:
    keys: tuple[bytes, ...]  # rank 0's keys of the save's chunks
    reports: int = 0  # workers (tensor-parallel ranks) that reported it done


class SchedulerCore:
    """Per-request bookkeeping behind get_num_new_matched_tokens and friends.

    `lookup(keys, prefetch)` says what the store holds of one rank's keys;
    `namespaces(salt)` gives one namespace per tensor-parallel rank for a request's
    salt. `prefetch` None: no promotion, every stored chunk counts at once.
    Counters (take_counters): save_wait.requests held for in-flight saves, the time
    they were held (save_wait.ms), and those that stopped waiting at the deadline
    (save_wait.expired), besides the prefetch policy's.
    """

    def __init__(self, chunk_tokens: int, block_size: int,
                 namespaces: Callable[[str], Sequence[KVNamespace]],
                 lookup: Lookup, load_async: bool, prefetch: PrefetchPolicy | None = None,
                 stage_on_arrival: bool = False, wait_for_saves_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.blocks_per_chunk = chunk_tokens // block_size
        self._namespaces = namespaces
        self._lookup = lookup
        self.load_async = load_async
        self.prefetch = PrefetchTracker(prefetch, clock) if prefetch is not None else None
        self.stage_on_arrival = stage_on_arrival  # workers have device staging pools
        self._arrived: dict[str, list[list[bytes]]] = {}  # keys computed at arrival
        self._requests: dict[str, _Request] = {}
        self._plan = StepPlan(load_async=load_async)
        self.wait_for_saves_s = wait_for_saves_s
        self._clock = clock
        self._num_ranks = len(namespaces(""))
        self._saves: dict[int, _Saving] = {}  # in flight, by save_id
        self._in_flight: Counter[bytes] = Counter()  # rank 0 key -> saves of it in flight
        self._last_save_id = 0
        self._held_since: dict[str, float] = {}  # requests held for in-flight saves
        self._released: set[str] = set()  # requests whose hold has ended
        self.counters: Counter[str] = Counter()

    def _keys(self, prompt: Sequence[int], salt: str) -> list[list[bytes]]:
        return [chunk_keys(prompt, ns) for ns in self._namespaces(salt)]

    def _residency(self, keys: list[list[bytes]], prefetch: bool) -> Residency:
        if not keys[0]:
            return Residency(0, 0)
        return self._lookup(keys, prefetch)

    def on_arrival(self, req_id: str, prompt: Sequence[int], salt: str = "") -> None:
        """A request entered the waiting queue: start promoting its stored chunks now,
        long before the scheduler reaches it, and have the workers stage them."""
        if self.prefetch is None and not self.stage_on_arrival:
            return
        keys = self._arrived[req_id] = self._keys(prompt, salt)
        residency = self._residency(keys, prefetch=self.prefetch is not None)
        if self.prefetch is not None:
            self.prefetch.arrived(req_id, residency)
        if self.stage_on_arrival and residency.stored:
            self._plan.stages.append(Stage(req_id, tuple(tuple(k[: residency.stored]) for k in keys)))

    def hint(self, prompt: Sequence[int], salt: str = "") -> None:
        """Tokens a future request will start with: promote what the store holds of them."""
        self._residency(self._keys(prompt, salt), prefetch=True)

    def num_new_matched_tokens(self, req_id: str, prompt: Sequence[int], num_computed: int,
                               salt: str = "") -> int | None:
        """Tokens beyond `num_computed` (the engine's own hit) that the store can supply,
        or None: saves of its next chunks are in flight, or the prefetch policy holds
        the request; ask again later."""
        arrived = self._arrived.get(req_id)
        keys = arrived if arrived is not None else self._keys(prompt, salt)
        residency = self._residency(keys, prefetch=self.prefetch is not None and arrived is None)
        if self._held_for_saves(req_id, keys[0], residency.stored):
            self._arrived[req_id] = keys
            return None
        usable = residency.stored
        if self.prefetch is not None:
            decided = self.prefetch.decide(req_id, residency, len(prompt))
            if decided is None:
                self._arrived[req_id] = keys
                return None
            usable = decided
        load_end = min(usable, (len(prompt) - 1) // self.chunk_tokens) * self.chunk_tokens
        self._requests[req_id] = _Request(keys, len(prompt), load_end, saved_chunks=residency.stored)
        return max(0, load_end - num_computed)

    def _held_for_saves(self, req_id: str, keys: list[bytes], stored: int) -> bool:
        """True while the chunk after the stored run is being saved by this engine, for
        at most wait_for_saves_s from the first ask; a request is held once at most."""
        if self.wait_for_saves_s <= 0 or req_id in self._released:
            return False
        now = self._clock()
        in_flight = stored < len(keys) and self._in_flight.get(keys[stored], 0) > 0
        held_since = self._held_since.get(req_id)
        if in_flight and (held_since is None or now - held_since < self.wait_for_saves_s):
            self._held_since.setdefault(req_id, now)
            return True
        if held_since is not None:  # the hold ends: the saves landed, or the deadline passed
            del self._held_since[req_id]
            self._released.add(req_id)
            self.counters["save_wait.requests"] += 1
            self.counters["save_wait.ms"] += round((now - held_since) * 1000)
            self.counters["save_wait.expired"] += int(in_flight)
        return False

    def saves_done(self, save_ids: Iterable[int]) -> None:
        """Workers report saves done (one report per rank); a save leaves the in-flight
        set once every rank has reported it."""
        for save_id in save_ids:
            saving = self._saves.get(save_id)
            if saving is None:
                continue
            saving.reports += 1
            if saving.reports >= self._num_ranks:
                del self._saves[save_id]
                for key in saving.keys:
                    self._in_flight[key] -= 1
                    if self._in_flight[key] <= 0:
                        del self._in_flight[key]

    def take_counters(self) -> dict[str, int]:
        """Counters since the last call (this core's and its prefetch policy's)."""
        counters, self.counters = self.counters, Counter()
        if self.prefetch is not None:
            counters.update(self.prefetch.take_counters())
        return dict(counters)

    def on_alloc(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """Blocks are allocated: plan the load of the last `num_external` tokens of the hit
        (the engine may have trimmed its own hit since the lookup; the hit's end holds)."""
        request = self._requests.get(req_id)
        if request is None or num_external == 0:
            return
        request.block_ids = list(block_ids)
        num_computed = request.load_end - num_external
        first_chunk = num_computed // self.chunk_tokens
        end_chunk = request.load_end // self.chunk_tokens
        first_needed_block = num_computed // self.block_size
        blocks = []
        for chunk in range(first_chunk, end_chunk):
            ids = self._chunk_blocks(request, chunk)
            start = chunk * self.blocks_per_chunk
            blocks.append(tuple(SKIP if start + i < first_needed_block else b
                                for i, b in enumerate(ids)))
        self._plan.loads.append(self._transfer(req_id, request, first_chunk, blocks))

    def on_scheduled(self, req_id: str, block_ids: Sequence[int] | None, replace: bool,
                     computed_after_step: int) -> None:
        """A request runs this step; chunks it completes are saved after the forward."""
        request = self._requests.get(req_id)
        if request is None:
            return
        if block_ids is not None:
            request.block_ids = list(block_ids) if replace else request.block_ids + list(block_ids)
        done = min(computed_after_step, request.num_prompt_tokens) // self.chunk_tokens
        done = min(done, len(request.keys[0]))
        if done <= request.saved_chunks:
            return
        first = request.saved_chunks
        blocks = [self._chunk_blocks(request, chunk) for chunk in range(first, done)]
        self._last_save_id += 1
        save = self._transfer(req_id, request, first, blocks, save_id=self._last_save_id)
        self._plan.saves.append(save)
        self._saves[save.save_id] = _Saving(save.keys[0])
        self._in_flight.update(save.keys[0])
        request.saved_chunks = done

    def take_plan(self) -> StepPlan:
        """The plan for this step; the next step starts empty."""
        plan, self._plan = self._plan, StepPlan(load_async=self.load_async)
        return plan

    def on_finished(self, req_id: str) -> None:
        """Forget the request; with prefetch on, keep its prompt's chunks warm in DRAM (the
        next turn of its conversation starts with them)."""
        request = self._requests.pop(req_id, None)
        self._arrived.pop(req_id, None)
        self._held_since.pop(req_id, None)
        self._released.discard(req_id)
        if self.prefetch is None:
            return
        self.prefetch.forget(req_id)
        if request is not None and request.saved_chunks:
            self._residency([k[: request.saved_chunks] for k in request.keys], prefetch=True)

    def _chunk_blocks(self, request: _Request, chunk: int) -> tuple[int, ...]:
        start = chunk * self.blocks_per_chunk
        ids = request.block_ids[start : start + self.blocks_per_chunk]
        if len(ids) != self.blocks_per_chunk:
            raise RuntimeError(f"chunk {chunk} has {len(ids)} blocks allocated, "
                               f"expected {self.blocks_per_chunk}")
        return tuple(ids)

    @staticmethod
    def _transfer(req_id: str, request: _Request, first: int,
                  blocks: list[tuple[int, ...]], save_id: int = 0) -> Transfer:
        end = first + len(blocks)
        return Transfer(
            req_id=req_id,
            keys=tuple(tuple(rank_keys[first:end]) for rank_keys in request.keys),
            parents=tuple(rank_keys[first - 1] if first else None for rank_keys in request.keys),
            blocks=tuple(blocks),
            save_id=save_id,
        )
