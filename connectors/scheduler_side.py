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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from connectors.plan import SKIP, StepPlan, Transfer
from kvstore.keys import KVNamespace, chunk_keys


@dataclass
class _Request:
    keys: list[list[bytes]]  # [rank][chunk] for every full prompt chunk
    num_prompt_tokens: int
    load_end: int  # token where a load from the store would end
    saved_chunks: int  # chunks [0, saved_chunks) are stored or queued for saving
    block_ids: list[int] = field(default_factory=list)


class SchedulerCore:
    """Per-request bookkeeping behind get_num_new_matched_tokens and friends.

    `lookup(keys)` returns how many leading keys the store holds; `namespaces(salt)`
    gives one namespace per tensor-parallel rank for a request's salt.
    """

    def __init__(self, chunk_tokens: int, block_size: int,
                 namespaces: Callable[[str], Sequence[KVNamespace]],
                 lookup: Callable[[list[bytes]], int], load_async: bool) -> None:
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.blocks_per_chunk = chunk_tokens // block_size
        self._namespaces = namespaces
        self._lookup = lookup
        self.load_async = load_async
        self._requests: dict[str, _Request] = {}
        self._plan = StepPlan(load_async=load_async)

    def num_new_matched_tokens(self, req_id: str, prompt: Sequence[int], num_computed: int,
                               salt: str = "") -> int:
        """Tokens beyond `num_computed` (the engine's own hit) that the store can supply."""
        keys = [chunk_keys(prompt, ns) for ns in self._namespaces(salt)]
        stored = min(self._lookup(rank_keys) for rank_keys in keys) if keys[0] else 0
        load_end = min(stored, (len(prompt) - 1) // self.chunk_tokens) * self.chunk_tokens
        self._requests[req_id] = _Request(keys, len(prompt), load_end, saved_chunks=stored)
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
        self._requests.pop(req_id, None)

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
