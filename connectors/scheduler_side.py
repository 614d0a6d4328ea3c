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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from connectors.plan import SKIP, Stage, StepPlan, Transfer
from connectors.prefetch import PrefetchPolicy, PrefetchTracker, Residency
from kvstore.keys import KVNamespace, chunk_keys

# (keys of one rank, start a promotion to DRAM?) -> what the store holds of them
Lookup = Callable[[list[bytes], bool], Residency]


@dataclass
class _Request:
    keys: list[list[bytes]]  # [rank][chunk] for every full prompt chunk
    num_prompt_tokens: int
    load_end: int  # token where a load from the store would end
    saved_chunks: int  # chunks [0, saved_chunks) are stored or queued for saving
    block_ids: list[int] = field(default_factory=list)


class SchedulerCore:
    """Per-request bookkeeping behind get_num_new_matched_tokens and friends.

    `lookup(keys, prefetch)` says what the store holds of one rank's keys;
    `namespaces(salt)` gives one namespace per tensor-parallel rank for a request's
    salt. `prefetch` None: no promotion, every stored chunk counts at once.
    """

    def __init__(self, chunk_tokens: int, block_size: int,
                 namespaces: Callable[[str], Sequence[KVNamespace]],
                 lookup: Lookup, load_async: bool, prefetch: PrefetchPolicy | None = None,
                 stage_on_arrival: bool = False) -> None:
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.blocks_per_chunk = chunk_tokens // block_size
        self._namespaces = namespaces
        self._lookup = lookup
        self.load_async = load_async
        self.prefetch = PrefetchTracker(prefetch) if prefetch is not None else None
        self.stage_on_arrival = stage_on_arrival  # workers have device staging pools
        self._arrived: dict[str, list[list[bytes]]] = {}  # keys computed at arrival
        self._requests: dict[str, _Request] = {}
        self._plan = StepPlan(load_async=load_async)

    def _keys(self, prompt: Sequence[int], salt: str) -> list[list[bytes]]:
        return [chunk_keys(prompt, ns) for ns in self._namespaces(salt)]

    def _residency(self, keys: list[list[bytes]], prefetch: bool) -> Residency:
        if not keys[0]:
            return Residency(0, 0)
        return Residency.across_ranks([self._lookup(rank_keys, prefetch) for rank_keys in keys])

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
        or None: the prefetch policy holds the request, ask again later."""
        arrived = self._arrived.get(req_id)
        keys = arrived if arrived is not None else self._keys(prompt, salt)
        residency = self._residency(keys, prefetch=self.prefetch is not None and arrived is None)
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
        self._plan.saves.append(self._transfer(req_id, request, first, blocks))
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
                  blocks: list[tuple[int, ...]]) -> Transfer:
        end = first + len(blocks)
        return Transfer(
            req_id=req_id,
            keys=tuple(tuple(rank_keys[first:end]) for rank_keys in request.keys),
            parents=tuple(rank_keys[first - 1] if first else None for rank_keys in request.keys),
            blocks=tuple(blocks),
        )
