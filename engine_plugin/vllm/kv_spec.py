"""What vLLM's KV cache config means for kvstore, checked once at start-up.

- The KV cache groups (engine_plugin/vllm/kv_groups.py): the connector implements vLLM's
  SupportsHMA, so a hybrid model keeps its groups; each is stored on its own. Their
  dtype is the first group's (vLLM gives every attention group the model's KV dtype).
- The dtype name in record headers: torch's name without "torch." (the header field
  holds 16 bytes; "torch.float8_e4m3fn" is 19). A name still too long is refused.
- The layout signature in chunk keys: what fixes a chunk's bytes, including vLLM's
  --kv-cache-dtype, because fp8_e4m3 and fp8_e5m2 are both stored as uint8 on the CPU
  backend and must never share chunks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvstore.format.errors import KVStoreError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

RECORD_DTYPE_BYTES = 16  # kvstore/format/record.py: the header's dtype name field


class UnsupportedKVCache(KVStoreError, ValueError):
    """The engine's KV cache cannot be stored by kvstore; the message says why."""


def first_group_spec(kv_cache_config: KVCacheConfig) -> KVCacheSpec:
    """The spec of the first KV cache group (whose dtype names records); none is refused."""
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise UnsupportedKVCache("TieredKVConnector stores KV caches; this engine has no KV cache group")
    return groups[0].kv_cache_spec


def spec_dtype(spec: KVCacheSpec) -> torch.dtype:
    """The torch dtype of a group's KV (a uniform-type group: its first layer's)."""
    first = getattr(spec, "first_spec", spec)
    dtype = getattr(first, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedKVCache(f"TieredKVConnector stores attention KV caches; this engine's "
                                 f"KV cache spec is {type(spec).__name__}")
    return dtype


def record_dtype_name(dtype: torch.dtype) -> str:
    """The dtype's name as record headers hold it: 'float16', 'float8_e4m3fn', ..."""
    name = str(dtype).removeprefix("torch.")
    if len(name.encode("ascii")) > RECORD_DTYPE_BYTES:
        raise UnsupportedKVCache(f"KV cache dtype {name!r} has a name longer than the "
                                 f"{RECORD_DTYPE_BYTES} bytes a kvstore record header holds")
    return name


def layout_signature(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str:
    """What fixes a chunk's byte layout, known to scheduler and workers alike."""
    parts = [vllm_config.device_config.device_type, f"kv:{vllm_config.cache_config.cache_dtype}"]
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        parts.append(f"{type(spec).__name__}:L{len(group.layer_names)}:b{spec.block_size}:"
                     f"h{getattr(spec, 'num_kv_heads', '')}:d{getattr(spec, 'head_size', '')}:"
                     f"{getattr(spec, 'dtype', '')}")
    if kv_cache_config.kv_cache_layout:
        parts.append(kv_cache_config.kv_cache_layout)
    return "/".join(parts)
