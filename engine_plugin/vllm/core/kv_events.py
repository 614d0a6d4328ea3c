"""What an engine tells a KV-aware router about kvstore: chunks entering and leaving tiers.

Routers (llm-d, Dynamo) index engines' KV events by the engine's own block hashes and
token ids; kvstore knows a chunk by its key. The service logs which chunk entered or
left which tier (kvstore/service/chunk_events.py); the scheduler remembers, for the chunks of
the requests it saw, the engine's block hashes, tokens and LoRA (the most recent
CAPACITY chunks: about 1.3 KB each); this joins the two. A chunk this scheduler never
saw (another engine's on the same service) is skipped: that engine reports it. With
tensor parallelism, rank 0's chunks stand for all ranks'. A hybrid model's chunks carry
their KV cache group (vLLM's group index, spec kind and sliding window), as vLLM's own
events do.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine_plugin.vllm.core.groups import KVGroup

CAPACITY = 1 << 14  # chunks remembered


@dataclass(frozen=True, slots=True)
class ChunkBlocks:
    """One chunk as the engine knows it: its blocks' hashes, the hash of the block before
    it, its tokens, and the LoRA adapter it was computed with."""

    block_hashes: tuple[Any, ...]
    parent_hash: Any | None
    token_ids: array
    lora_id: int | None
    lora_name: str | None
    group: KVGroup | None = None  # a hybrid model's KV cache group; None: the model has one


@dataclass(frozen=True, slots=True)
class ChunkEvent:
    stored: bool  # else removed
    medium: str  # kvstore-dram, kvstore-disk, kvstore-nvmeof
    blocks: ChunkBlocks


class ChunkCatalog:
    def __init__(self, chunk_tokens: int, block_size: int, capacity: int = CAPACITY) -> None:
        self.chunk_tokens = chunk_tokens
        self.blocks_per_chunk = chunk_tokens // block_size
        self.capacity = capacity
        self._chunks: OrderedDict[bytes, ChunkBlocks] = OrderedDict()
        self.unknown = 0  # events about chunks this scheduler did not see

    def remember(self, keys: Sequence[bytes], token_ids: Sequence[int], block_hashes: Sequence[Any],
                 lora_id: int | None = None, lora_name: str | None = None,
                 group: KVGroup | None = None) -> None:
        """A request's chunk keys, with the engine's hashes of its blocks (hashes of blocks
        not full yet may be missing: those chunks are left out)."""
        per = self.blocks_per_chunk
        for i, key in enumerate(keys):
            hashes = tuple(block_hashes[i * per : (i + 1) * per])
            if len(hashes) < per:
                break
            tokens = array("i", token_ids[i * self.chunk_tokens : (i + 1) * self.chunk_tokens])
            self._chunks[key] = ChunkBlocks(hashes, block_hashes[i * per - 1] if i else None, tokens,
                                            lora_id, lora_name, group)
            self._chunks.move_to_end(key)
        while len(self._chunks) > self.capacity:
            self._chunks.popitem(last=False)

    def translate(self, events: Sequence[tuple[bool, bytes, str]]) -> list[ChunkEvent]:
        found = []
        for stored, key, medium in events:
            blocks = self._chunks.get(key)
            if blocks is None:
                self.unknown += 1
            else:
                found.append(ChunkEvent(stored, medium, blocks))
        return found
