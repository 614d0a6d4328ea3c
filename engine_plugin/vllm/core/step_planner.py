"""The step plan the scheduler side builds for the workers: which chunks each request loads
into which of its blocks, which chunks it saves after the forward pass, and which are
staged on the workers' devices ahead of a load.

The scheduler decides; the plan (engine_plugin/vllm/core/plan.py) only says what the
workers move, each on its own shard, so every choice of what to write is made here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal

from engine_plugin.vllm.core.groups import KVGeometry, load_run, save_runs
from engine_plugin.vllm.core.plan import SKIP, Stage, StepPlan
from engine_plugin.vllm.core.request_state import RequestState
from engine_plugin.vllm.core.save_tracker import SaveTracker

Saves = Literal["answers", "prompts", "none"]


def _streams(position: int, ranks: int) -> slice:
    """Which of a request's key lists (one per group and rank) are the group at `position`'s."""
    return slice(position * ranks, (position + 1) * ranks)


class StepPlanner:
    """Builds one step's StepPlan from what the scheduler decided, per KV cache group.

    Invariants:
    - A load writes, per group, the chunks between the engine's own hit and the hit's end
      (engine_plugin/vllm/core/groups.py: load_run): blocks the engine already holds, or
      keeps none of, are SKIP and never written; leading chunks with nothing to write are
      left out, and a group with nothing to write has no transfer.
    - A chunk is saved once, in the step in which its last token's KV is computed, and only
      if the store did not hold it at the lookup: a request's saves run from its
      `saved_chunks` to the chunks complete after this step (up to its prompt's end with
      `saves="prompts"`, none with `"none"`), each group's chunks worth storing, and every
      save is in flight (SaveTracker.started) from the step that plans it.
    - Each group's transfers carry that group's keys, blocks and leased offsets (streams
      group-major, `ranks` per group).
    - A request given up after a fault is never half-loaded (StepPlan.give_up).
    - `take` hands the plan over once; the next step's starts empty.
    """

    def __init__(self, geometry: KVGeometry, ranks: int, saves: Saves, in_flight: SaveTracker) -> None:
        self.geometry = geometry
        self.ranks = ranks
        self.saves = saves
        self._in_flight = in_flight
        self._plan = StepPlan(1)

    def stage(self, req_id: str, keys: list[list[bytes]], stored: int) -> None:
        """Have the workers stage the `stored` leading chunks of `keys` (per stream)."""
        self._plan.stages.append(Stage(req_id, tuple(tuple(k[:stored]) for k in keys)))

    def load(self, req_id: str, request: RequestState, num_external: int) -> set[int]:
        """Plan the load of the last `num_external` tokens of the request's hit into its
        blocks (the engine may have trimmed its own hit since the lookup; the hit's end
        holds); the blocks it writes (none: nothing to load)."""
        geometry = self.geometry
        num_computed = request.load_end - num_external
        written: set[int] = set()
        for position, group in enumerate(geometry.groups):
            blocks_of = functools.partial(request.chunk_blocks, per_chunk=geometry.blocks_per_chunk,
                                          group=group.index)
            run = load_run(group, blocks_of, num_computed, request.load_end, geometry.chunk_tokens,
                           geometry.block_size)
            if run is not None:
                streams = _streams(position, self.ranks)
                transfer = request.transfer(req_id, run[0], run[1], streams, group.index)
                self._plan.loads.append(transfer)
                written.update(b for blocks in transfer.blocks for b in blocks if b != SKIP)
        return written

    def save(self, req_id: str, request: RequestState, computed_after_step: int) -> None:
        """Plan the saves of the chunks the request completes in this step."""
        if self.saves == "none":
            return
        geometry = self.geometry
        limit = request.prompt_tokens if self.saves == "prompts" else len(request.tokens)
        done = min(computed_after_step, limit) // geometry.chunk_tokens
        if done <= request.saved_chunks:
            return
        request.extend_keys(done, geometry.chunk_tokens)
        for position, group in enumerate(geometry.groups):
            runs = save_runs(geometry.rules, group, request.prompt_tokens, request.saved_chunks, done,
                             functools.partial(request.chunk_blocks, per_chunk=geometry.blocks_per_chunk,
                                               group=group.index))
            for first, blocks in runs:
                keys = request.keys[position * self.ranks][first : first + len(blocks)]
                streams = _streams(position, self.ranks)
                self._plan.saves.append(request.transfer(req_id, first, blocks, streams, group.index,
                                                         self._in_flight.started(keys)))
        request.saved_chunks = done

    def give_up(self, req_id: str, blocks: Sequence[Sequence[int]] = (), load_async: bool = True) -> bool:
        """A fault while serving `req_id`: StepPlan.give_up."""
        return self._plan.give_up(req_id, blocks, load_async)

    def take(self) -> StepPlan:
        """This step's plan; the next step's starts empty, numbered one more."""
        plan, self._plan = self._plan, StepPlan(self._plan.step + 1)
        return plan
