"""What moves in one engine step: chunk transfers between the store and KV blocks.

The scheduler side builds a StepPlan each step; the engine ships it to every
worker, which carries it out on its own shard. It is plain data (picklable) because
it crosses process boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

SKIP = -1  # a block id that a load must not write (the engine already holds it)


@dataclass(frozen=True)
class Transfer:
    """A run of consecutive chunks of one request.

    keys[rank][i] is chunk i's key in tensor-parallel rank `rank`'s namespace;
    parents[rank] is the key before chunk 0 (None for a prompt's first chunk);
    blocks[i] lists the engine block ids chunk i occupies, in token order.
    A save has a `save_id`, by which each worker reports it done (stored or given up),
    so the scheduler knows which chunks are still on their way to the store.
    A hybrid model's groups each move in transfers of their own (keys of that group).
    A load with no keys at all was given up by the scheduler after a fault
    (SchedulerCore.abandon): workers report its blocks failed, so the engine recomputes them.
    namespaces[rank] is the digest of the namespace rank `rank`'s keys were made in: a
    save's records carry it in their headers (what `kvstore purge` finds them by).
    A load's `leased[rank][i]` is where chunk i's payload lies in the service's shared DRAM
    tier, pinned by the scheduler's lookup for this load (-1, or none at all: fetch it):
    the worker copies it from there with no request of its own. `load_async`: the load
    runs while its request waits outside the batch (reported finished), else before the
    forward pass of this step; the scheduler told the engine which, per request.
    """

    req_id: str
    keys: tuple[tuple[bytes, ...], ...]
    parents: tuple[bytes | None, ...]
    blocks: tuple[tuple[int, ...], ...]
    save_id: int = 0
    group: int = 0  # the engine's KV cache group whose blocks these are (hybrid models)
    namespaces: tuple[bytes, ...] = ()
    leased: tuple[tuple[int, ...], ...] = ()
    load_async: bool = True

    @property
    def num_chunks(self) -> int:
        return len(self.blocks)


@dataclass(frozen=True)
class Stage:
    """Chunks to fetch into the workers' device pools ahead of a load (keys[rank][i])."""

    req_id: str
    keys: tuple[tuple[bytes, ...], ...]


@dataclass
class StepPlan:
    """One step's transfers. `step` numbers the plans (from 1): a worker reports the plans
    whose sync loads it carried out by number, as a report may come after the next plan
    ships (vLLM's async scheduling)."""

    step: int = 0
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    stages: list[Stage] = field(default_factory=list)

    def give_up(self, req_id: str, blocks: Sequence[Sequence[int]] = (), load_async: bool = True) -> bool:
        """Never half-load `req_id` after a fault: its loads become given-up ones (no keys:
        every block reported failed and, if async, the load finished, so the engine
        recomputes them), or, with none planned, `blocks` (per KV cache group) do, async as
        the engine was told (`load_async`); its stages are dropped; its saves stay (their
        keys and blocks were whole when planned). True if a load that would have copied
        was in this plan (one already shipped still copies)."""
        copied = any(t.keys for t in self.loads if t.req_id == req_id)
        mine = [(t.blocks, t.group, t.load_async) for t in self.loads if t.req_id == req_id]
        given_up = mine or [((tuple(ids),), group, load_async) for group, ids in enumerate(blocks) if ids]
        self.loads = [t for t in self.loads if t.req_id != req_id]
        self.loads += [Transfer(req_id, (), (), ids, group=group, load_async=was_async)
                       for ids, group, was_async in given_up]
        self.stages = [s for s in self.stages if s.req_id != req_id]
        return copied
