"""What moves in one engine step: chunk transfers between the store and KV blocks.

The scheduler side builds a StepPlan each step; the engine ships it to every
worker, which carries it out on its own shard. It is plain data (picklable) because
it crosses process boundaries.
"""

from __future__ import annotations

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
    """

    req_id: str
    keys: tuple[tuple[bytes, ...], ...]
    parents: tuple[bytes | None, ...]
    blocks: tuple[tuple[int, ...], ...]
    save_id: int = 0
    group: int = 0  # the engine's KV cache group whose blocks these are (hybrid models)

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
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    stages: list[Stage] = field(default_factory=list)
    load_async: bool = True
