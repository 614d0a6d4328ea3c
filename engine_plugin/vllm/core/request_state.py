"""A request as the scheduler side knows it, from the lookup that decides its load to its
end: its keys, its blocks, what the lookup found and how far it is saved."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine_plugin.vllm.core.groups import per_group
from engine_plugin.vllm.core.plan import Transfer
from engine_plugin.vllm.core.prefetch import Residency
from kvstore.format.keys import KeyExtras, KVNamespace, chunk_keys


@dataclass
class RequestState:
    """One request's keys and blocks, and what the store held of them.

    Invariants:
    - `keys` holds one key list per stream (KV cache group and tensor-parallel rank,
      group-major), each with a key for every full chunk of the tokens known so far, all
      made in `namespaces`, the namespaces of its lookup: a new generation since does not
      move its chains, and its keys cover what its token ids do not show (`extras`).
    - `found` is the lookup's answer: the chunks stored and in DRAM, and the offsets of the
      DRAM run its lease pinned (the lease itself is engine_plugin/vllm/core/leases.py's).
    - Chunks [0, saved_chunks) are stored or queued for saving; it only grows.
    """

    keys: list[list[bytes]]  # [stream][chunk]
    tokens: Sequence[int]  # the engine's live token list (prompt, then what it generates)
    namespaces: Sequence[KVNamespace]  # each key list's (one per group and rank), as at the lookup
    extras: KeyExtras | None  # what its keys cover besides its tokens
    load_end: int  # token where a load from the store would end
    found: Residency  # what the store held at the lookup (stored chunks, those in DRAM, leased offsets)
    prompt_tokens: int = 0  # tokens known at the lookup: boundaries a later hit may end on
    block_ids: list[list[int]] = field(default_factory=list, init=False)  # per KV cache group (vLLM's index)
    load_async: bool = field(default=True, init=False)  # what the engine was told at the match
    saved_chunks: int = field(init=False)  # chunks [0, saved_chunks) are stored or queued for saving
    turn_idle: tuple[int, float | None] = field(default=(0, None), init=False)  # ChainReports.planned

    def __post_init__(self) -> None:
        self.saved_chunks = self.found.stored

    def allocated(self, block_ids: Sequence[int] | Sequence[Sequence[int]], replace: bool) -> None:
        """vLLM gave it blocks (per group, or one group's list): they replace its blocks, or
        follow them (a running request's new blocks)."""
        new = per_group(block_ids)
        self.block_ids = new if replace or not self.block_ids else [
            old + ids for old, ids in zip(self.block_ids, new, strict=True)]

    def extend_keys(self, chunks: int, chunk_tokens: int) -> None:
        """Hash the keys of the first `chunks` chunks that generated tokens filled, on each
        stream's chain, in the namespaces its prompt was keyed in (a new generation since
        does not move a running request's chains)."""
        have = len(self.keys[0])
        if have >= chunks:
            return
        tokens = list(self.tokens[have * chunk_tokens : chunks * chunk_tokens])
        for stream_keys, namespace in zip(self.keys, self.namespaces, strict=True):
            parent = stream_keys[-1] if stream_keys else bytes(16)
            stream_keys += chunk_keys(tokens, namespace, parent, self.extras, first=have)

    def chunk_blocks(self, chunk: int, per_chunk: int, group: int = 0) -> tuple[int, ...]:
        """The block ids of chunk `chunk` in KV cache group `group`."""
        ids = self.block_ids[group][chunk * per_chunk : (chunk + 1) * per_chunk]
        if len(ids) != per_chunk:
            raise RuntimeError(f"chunk {chunk} has {len(ids)} blocks allocated, expected {per_chunk}")
        return tuple(ids)

    def ending(self) -> tuple[list[list[bytes]], int, int, tuple[int, float | None]]:
        """What ChainReports.ended asks: each rank's keys of the chunks stored or queued for
        saving, the tokens known (prompt and answer), the prompt's, its turn and idle time."""
        stored = [rank_keys[: self.saved_chunks] for rank_keys in self.keys]
        return stored, len(self.tokens), self.prompt_tokens, self.turn_idle

    def sources(self, num_external: int, chunk_tokens: int) -> dict[str, int]:
        """The last `num_external` tokens of the hit by the tier that held them at the lookup:
        `dram` and `disk` (this host's disk or the shared array); zeros left out."""
        start = self.load_end - num_external
        dram = max(0, min(self.found.resident * chunk_tokens, self.load_end) - start)
        return {tier: tokens for tier, tokens in (("dram", dram), ("disk", num_external - dram)) if tokens}

    def transfer(self, req_id: str, first: int, blocks: list[tuple[int, ...]], streams: slice,
                 group: int, save_id: int = 0) -> Transfer:
        """Chunks [first, first + len(blocks)) of the group whose keys are `streams` of self.keys."""
        end = first + len(blocks)
        keys = self.keys[streams]
        leased = () if save_id else tuple(
            tuple(offsets[i] if i < len(offsets) else -1 for i in range(first, end))
            for offsets in self.found.offsets[streams])
        return Transfer(req_id=req_id, keys=tuple(tuple(rank_keys[first:end]) for rank_keys in keys),
                        parents=tuple(rank_keys[first - 1] if first else None for rank_keys in keys),
                        blocks=tuple(blocks), save_id=save_id, group=group,
                        namespaces=tuple(ns.digest() for ns in self.namespaces[streams]), leased=leased,
                        load_async=self.load_async)

    def leased_whole(self, first: int, end: int) -> bool:
        """Every chunk from `first` to `end` is leased, on every rank (DRAM: a copy, no I/O)."""
        return bool(self.found.lease) and end > first and all(
            len(offsets) >= end and min(offsets[first:end]) >= 0 for offsets in self.found.offsets)
