"""kvstore's chunk events as vLLM KV events, for routers that credit a DRAM, disk or
array hit (llm-d, Dynamo): BlockStored / BlockRemoved with medium `kvstore-dram`,
`kvstore-disk` or `kvstore-nvmeof` (the array every host of a cluster reads).

vLLM asks the scheduler's connector for events each step (`take_events`) when
`--kv-events-config` enables them; this asks the service what changed since its last
cursor (one request, on the lookup connection) and names each chunk by vLLM's hashes of
its blocks (engine_plugin/vllm/core/kv_events.py). A failure costs events, never the step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from connectors.link import ServiceLink
from engine_plugin.vllm.core.groups import KVGroup
from engine_plugin.vllm.core.kv_events import ChunkCatalog
from kvstore.format.keys import KeyExtras, KVNamespace, chunk_keys

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvstore")


class RouterEvents:
    def __init__(self, chunk_tokens: int, block_size: int, link: ServiceLink) -> None:
        self.catalog = ChunkCatalog(chunk_tokens, block_size)
        self.block_size = block_size
        self.link = link
        self.cursor = -1  # from whatever happens after the first answer
        self._lost_logged = False
        self.take()  # learns the current cursor: what happened before this engine is not its news

    def remember(self, request: Request, namespaces: Sequence[tuple[KVNamespace, KVGroup | None]],
                 extras: KeyExtras | None = None) -> None:
        """The request's chunks in each KV cache group (rank 0's namespace of each)."""
        tokens = request.prompt_token_ids or []
        lora = request.lora_request
        for namespace, group in namespaces:
            self.catalog.remember(chunk_keys(tokens, namespace, extras=extras), tokens, request.block_hashes,
                                  lora.adapter_id if lora else None, lora.name if lora else None, group)

    def take(self) -> list[KVCacheEvent]:
        client = self.link.get()
        if client is None:
            return []
        try:
            self.cursor, lost, events = client.events(self.cursor)
        except Exception as exc:  # the cache must never take the scheduler down
            log.warning("kvstore: KV events not read (%s)", exc)
            self.link.fail()
            return []
        if lost and not self._lost_logged:
            log.warning("kvstore: %d KV events lost (the service's log overflowed between steps)", lost)
            self._lost_logged = True
        return self._vllm_events(events)

    def _vllm_events(self, events: Sequence[tuple[bool, bytes, str]]) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        for event in self.catalog.translate(events):
            blocks = event.blocks
            hashes = [maybe_convert_block_hash(h) for h in blocks.block_hashes]
            group = blocks.group
            if not event.stored:
                out.append(BlockRemoved(block_hashes=hashes, medium=event.medium,
                                        group_idx=group.index if group else None))
                continue
            parent = maybe_convert_block_hash(blocks.parent_hash) if blocks.parent_hash is not None else None
            out.append(BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                   token_ids=blocks.token_ids.tolist(), block_size=self.block_size,
                                   lora_id=blocks.lora_id, medium=event.medium,
                                   lora_name=blocks.lora_name, group_idx=group.index if group else None,
                                   kv_cache_spec_kind=group.kind if group else None,
                                   kv_cache_spec_sliding_window=group.sliding_window if group else None))
        return out
