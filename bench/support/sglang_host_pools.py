"""SGLang's own host KV pools, built on the CPU for the HiCache backend's tests and benchmark.

These are SGLang's classes (MHATokenToKVPoolHost, MLATokenToKVPoolHost, and a hybrid
model's MambaPoolHost), laid out from CPU device buffers, as SGLang's own storage unit
tests build them. One
obstacle: SGLang's memory_pool module imports sglang.srt.configs, which imports
torchvision at import time for a vision model's image constants. PyPI's torchvision is
built against CUDA torch and does not load next to the CPU torch==2.13.0 (its operators
fail to register), and nothing in the KV pools uses it. So where torchvision does not
import, `import_pools` first lets transformers see it missing, then puts SGLang's own
module stand-in in its place (sglang._platform_stubs._MockModule, which SGLang itself
uses for Triton on Apple Silicon).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from bench.support.sglang_cpu import StandIn

PAGE_SIZE = 16  # tokens per page


def import_pools() -> tuple[Any, Any, Any, Any]:
    """(MHATokenToKVPool, MHATokenToKVPoolHost, MLATokenToKVPool, MLATokenToKVPoolHost)."""
    stand_in = None
    try:
        import torchvision  # noqa: F401
    except Exception:
        # transformers notes at import whether torchvision is there; it must see it absent,
        # not take the stand-in for the real thing.
        import transformers  # noqa: F401
        _forget_torchvision()
        stand_in = StandIn(["torchvision"])
        sys.meta_path.insert(0, stand_in)
    try:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    finally:
        if stand_in is not None:  # only these imports see it: a later `import torchvision` fails as before
            sys.meta_path.remove(stand_in)
            _forget_torchvision()
    return MHATokenToKVPool, MHATokenToKVPoolHost, MLATokenToKVPool, MLATokenToKVPoolHost


def _forget_torchvision() -> None:
    for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
        del sys.modules[name]


def mha_host_pool(layout: str, pages: int, layers: int = 4, heads: int = 2, head_dim: int = 64,
                  dtype: torch.dtype = torch.float16) -> Any:
    """SGLang's MHA host pool of `pages` pages (plus SGLang's padding page) in `layout`
    (page_first, page_first_direct, page_head or layer_first)."""
    device_cls, host_cls, _, _ = import_pools()
    device = device_cls(PAGE_SIZE * 4, PAGE_SIZE, dtype, heads, head_dim, layers, "cpu", False,
                        start_layer=0, end_layer=layers - 1)
    return host_cls(device.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE_SIZE, layout,
                    pin_memory=False, device_capacity_tokens=device.size, start_layer=0,
                    end_layer=layers - 1, host_token_capacity=pages * PAGE_SIZE)


def mla_host_pool(layout: str, pages: int, layers: int = 4, kv_lora_rank: int = 512,
                  rope_dim: int = 64, dtype: torch.dtype = torch.bfloat16) -> Any:
    """SGLang's MLA host pool (one latent vector per token and layer, no V)."""
    _, _, device_cls, host_cls = import_pools()
    device = device_cls(PAGE_SIZE * 4, PAGE_SIZE, dtype, kv_lora_rank, rope_dim, layers, "cpu", False,
                        start_layer=0, end_layer=layers - 1)
    return host_cls(device.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE_SIZE, layout,
                    pin_memory=False, device_capacity_tokens=device.size, start_layer=0,
                    end_layer=layers - 1, target_layer_num=layers, host_token_capacity=pages * PAGE_SIZE)


def mamba_host_pool(slots: int, layers: int = 2, heads: int = 6, state: tuple[int, int] = (32, 64),
                    conv: tuple[int, int] = (16, 3), side_state: int = 0) -> Any:
    """SGLang's Mamba state host pool (page_first, one state per page) of `slots` slots:
    an fp32 temporal state and a bf16 conv state per layer, as a hybrid model's, and with
    `side_state` a per-slot int32 side state of that many values (which SGLang's pool
    offers no zero-copy page metadata for: its pages move as flat pages)."""
    import_pools()
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(temporal=torch.zeros(layers, slots, heads, *state, dtype=torch.float32),
                                conv=(torch.zeros(layers, slots, *conv, dtype=torch.bfloat16),),
                                extra_checkpoint_buffers=(torch.zeros(slots, side_state, dtype=torch.int32),)
                                if side_state else ())
    return MambaPoolHost(info, 1.0, 0, device_capacity=slots, pin_memory=False, layout="page_first")


def storage_config(extra: dict[str, Any], tp_rank: int = 0, tp_size: int = 1, mla: bool = False,
                   page_first: bool = True, model: str = "test/model") -> Any:
    """SGLang's HiCacheStorageConfig as its cache controller fills it for one rank."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
                                is_page_first_layout=page_first, model_name=model, extra_config=extra)
