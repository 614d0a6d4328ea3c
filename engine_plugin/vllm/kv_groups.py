"""vLLM's KV cache groups as kvstore stores them: the groups' rules and one layout per group.

With the hybrid KV cache manager on (the connector implements SupportsHMA), a model
mixing attention types has one KV cache group per type, each with its own layers and
block table; the layers of different groups share the same KV tensors (vLLM hands each
group blocks of one pool). So a chunk is one group's blocks of that group's layers,
stored under that group's keys (its index, spec kind and geometry are in the
namespace). Full attention and sliding window groups are stored
(engine_plugin/vllm/core/groups.py says what of each); other kinds (Mamba state, chunked local
attention, cross attention) are refused at start-up, by name, rather than half-stored.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from engine_plugin.vllm.core.groups import GroupRules, KVGroup
from engine_plugin.vllm.core.options import ConnectorOptions
from engine_plugin.vllm.kv_spec import UnsupportedKVCache
from engine_plugin.vllm.layout import PagedKVLayout
from kvstore.format.errors import ConfigError, ShapeError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

log = logging.getLogger("vllm.kvstore")
FULL_KINDS = ("full_attention", "mla_attention")
WINDOW_KINDS = ("sliding_window", "sliding_window_mla")


def spec_kind(group: KVCacheGroupSpec) -> str:
    """vLLM's name for the group's kind of KV cache ('full_attention', 'sliding_window', ...)."""
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind
    except ImportError:  # an older vLLM: the kind from the class
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            return "sliding_window"
        return "full_attention" if isinstance(spec, FullAttentionSpec) else type(spec).__name__
    return str(get_kv_cache_spec_kind(group.kv_cache_spec).value)


def describe_groups(kv_cache_config: KVCacheConfig) -> str:
    return ", ".join(f"{spec_kind(g)} x{len(g.layer_names)} layers" for g in kv_cache_config.kv_cache_groups)


def kv_groups(kv_cache_config: KVCacheConfig) -> tuple[KVGroup, ...]:
    """The engine's groups, full attention first (a hit's leading run is theirs); refuses
    kinds kvstore does not store."""
    groups = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        kind = spec_kind(group)
        spec = group.kv_cache_spec
        if kind not in FULL_KINDS + WINDOW_KINDS:
            raise UnsupportedKVCache(
                f"TieredKVConnector stores full-attention and sliding-window KV cache groups; this "
                f"engine's group {index} is {kind} ({describe_groups(kv_cache_config)}). Run it "
                f"without kvstore")
        window = None
        if kind in WINDOW_KINDS:
            window = int(spec.sliding_window)  # type: ignore[attr-defined]
            window += int(getattr(spec, "extra_retained_tokens", 0) or 0)
        signature = (f"{index}:{kind}:w{window or 0}:L{len(group.layer_names)}:b{spec.block_size}:"
                     f"h{getattr(spec, 'num_kv_heads', '')}:d{getattr(spec, 'head_size', '')}:"
                     f"{getattr(spec, 'dtype', '')}")
        groups.append(KVGroup(index, kind, signature, window))
    return tuple(sorted(groups, key=lambda g: (g.windowed, g.index)))


def group_rules(kv_cache_config: KVCacheConfig, chunk_tokens: int, block_size: int,
                interval: int) -> GroupRules | None:
    """The rules for a hybrid model's groups; None for one group (stored as before)."""
    groups = kv_groups(kv_cache_config)
    if len(groups) == 1 and not groups[0].windowed:
        return None
    if interval % chunk_tokens:
        raise ConfigError("sliding_window_interval", interval,
                          f"must be a multiple of chunk_tokens ({chunk_tokens}), or 0")
    sizes = {g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups}
    if sizes != {block_size}:
        raise UnsupportedKVCache(f"TieredKVConnector needs one block size for every KV cache group; "
                                 f"this engine's are {sorted(sizes)} ({describe_groups(kv_cache_config)})")
    return GroupRules(groups, chunk_tokens, block_size, interval)


def failures_per_request(options: ConnectorOptions,
                         kv_cache_config: KVCacheConfig) -> tuple[ConnectorOptions, bool]:
    """(the options to run with, whether failed loads are reported per request). With more
    than one group, block ids are unique only within a group: vLLM cannot map failed ones
    back to requests (a RuntimeError that ends the engine) and takes failed requests
    instead, whose KV it recomputes whole, but only for async loads: so loads are async."""
    groups = len(kv_cache_config.kv_cache_groups)
    if groups <= 1:
        return options, False
    if not options.load_async:
        log.warning("kvstore: load_async forced on: this engine has %d KV cache groups, whose failed "
                    "loads vLLM recomputes only per request and only for async loads", groups)
        options = options.model_copy(update={"load_async": True})
    return options, True


class GroupedKVLayout:
    """One PagedKVLayout per group, over that group's layers; every group's chunk fits
    the largest group's chunk (a smaller one uses the front of its slot)."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], kv_cache_config: KVCacheConfig,
                 blocks_per_chunk: int) -> None:
        num_blocks = kv_cache_config.num_blocks
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.groups: dict[int, PagedKVLayout] = {}
        for index, group in enumerate(kv_cache_config.kv_cache_groups):
            layers = {name: kv_caches[name] for name in group.layer_names if name in kv_caches}
            if not layers:
                raise ShapeError(f"KV cache group {index} has no registered KV tensors")
            self.groups[index] = PagedKVLayout(layers, num_blocks, blocks_per_chunk)
        self.chunk_bytes = max(layout.chunk_bytes for layout in self.groups.values())
        self.device = next(iter(self.groups.values())).device
        self.blocks_per_chunk = blocks_per_chunk

    def describe(self) -> str:
        """Each group's layers and its KV bytes per token (`kvstore replay --kv-bytes-per-token`)."""
        tokens = self.blocks_per_chunk * self.block_size
        return "; ".join(f"group {g}: {layout.describe()}, {layout.chunk_bytes // tokens} B/token"
                         for g, layout in self.groups.items())

    def gather(self, blocks: Sequence[int], out: memoryview, group: int = 0) -> None:
        layout = self.groups[group]
        layout.gather(blocks, out[: layout.chunk_bytes])

    @property
    def smallest_copy(self) -> int:
        """The fewest bytes one copy of a load moves: the least of the groups' (layout.py)."""
        return min(layout.smallest_copy for layout in self.groups.values())

    @property
    def checks_copies(self) -> bool:
        """No: a group's chunk is the front of its record, whose checksum is the whole's."""
        return False

    def scatter(self, chunks: Sequence[tuple[memoryview | torch.Tensor, Sequence[int]]],
                group: int = 0, checks: Sequence[int | None] = ()) -> list[bool]:
        layout = self.groups[group]
        return layout.scatter([(src[: layout.chunk_bytes], blocks) for src, blocks in chunks])
