"""What vLLM's KV cache config means for kvstore, checked once at start-up.

- One KV cache group. The connector stores a chunk as the blocks of every layer under
  one block table. vLLM gives a model several groups only with its hybrid KV cache
  manager, which it turns off for a connector that does not implement SupportsHMA
  (this one): models mixing sliding-window and full attention (Gemma-2/3 style) then
  run with one group whose sliding-window layers keep full KV, and kvstore stores all
  of it. Several groups anyway (a future vLLM, another path) are refused, by name,
  rather than half-stored.
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


def single_group_spec(kv_cache_config: KVCacheConfig) -> KVCacheSpec:
    """The spec of the one KV cache group; several groups are refused, naming them."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        described = ", ".join(f"{type(g.kv_cache_spec).__name__} x{len(g.layer_names)} layers"
                              for g in groups)
        raise UnsupportedKVCache(
            f"TieredKVConnector stores models with one KV cache group; this engine has "
            f"{len(groups)} ({described or 'none'}). Run it with "
            f"--disable-hybrid-kv-cache-manager, or without kvstore")
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
