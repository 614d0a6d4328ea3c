"""SGLang 0.5.23's own HTTP server on a machine without a GPU: the stand-ins and patches it needs.

Test and benchmark support only (tests/test_sglang_server.py, bench/lab/sglang_ttft.py); nothing
in engine_plugin/ or kvstore/ imports it, and SGLang's kvstore backend runs unchanged
under it. It holds for sglang==0.5.23 only and refuses to run on another version: each
patch below replaces something of that version's by name, and a newer SGLang may have
moved it, or may no longer need it. Run in .venv-sglang (scripts/setup_sglang.sh) as

    SGLANG_USE_CPU_ENGINE=1 python -m bench.support.sglang_cpu [sglang.launch_server's arguments]

with `--device cpu --attention-backend torch_native --sampling-backend pytorch
--disable-cuda-graph`. SGLang starts its scheduler and detokenizer with multiprocessing's
`spawn`, which imports this module again in each child as `__mp_main__`: that is how
every process of the server gets what `install` sets up.

What it sets up, and why each is safe on this path (docs/sglang.md):
- `torchvision`: SGLang's configs import it for a vision model's image constants. PyPI's
  build is CUDA-linked and does not load next to the CPU torch. Stood in for by SGLang's
  own module stand-in (`sglang._platform_stubs._MockModule`, which SGLang uses for Triton
  on Apple Silicon), after transformers has cached that torchvision is absent (so its
  image processors never take the stand-in for the real thing).
- `sgl_kernel`: imported by SGLang's modules at load time; no CPU wheel of it (or of
  `sglang-kernel`) exists on the package index. The same stand-in: a text model served
  with the flags above never calls one of its functions; a call would get a stand-in
  back, not a result, so the comparison of answers in the tests would catch it.
- Host pools built unpinned: HiCache's host pools ask for pinned memory, which needs a
  CUDA driver.
- The `direct` io backend's copies between the device KV pool and the host pool
  (`transfer_kv_direct` for `layer_first`, `transfer_kv_per_layer_direct_pf_lf` and
  `transfer_kv_all_layer_direct_lf_pf` for `page_first_direct`, SGLang's `page_first`
  with `direct`): sgl_kernel's CUDA ops, here torch indexing with the same arguments.
- `torch.cpu.Stream.synchronize`: the cache controller waits on its copy streams; a CPU
  copy is done when it returns, so there is nothing to wait for.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import inspect
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

SGLANG_VERSION = "0.5.23"
STAND_INS = ("torchvision", "sgl_kernel")  # top-level packages served by the stand-in


class StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every module under `packages` as SGLang's _MockModule (each attribute a
    further stand-in; called, it hands back its argument or a pass-through decorator)."""

    def __init__(self, packages: Sequence[str]) -> None:
        self.packages = tuple(packages)

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] not in self.packages:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        from sglang._platform_stubs import _MockModule

        return _MockModule(spec.name)

    def exec_module(self, module: ModuleType) -> None:
        pass


def check_version() -> None:
    """Fails loudly on any SGLang but the one these patches were written against."""
    found = importlib.metadata.version("sglang")
    if found != SGLANG_VERSION:
        raise RuntimeError(f"bench/support/sglang_cpu.py holds for sglang=={SGLANG_VERSION}, and "
                           f"sglang=={found} is installed: check each patch against the new version "
                           f"(docs/sglang.md) before changing SGLANG_VERSION here and in "
                           f"scripts/setup_sglang.sh")


def transfer_kv_direct(src_layers: list[torch.Tensor], dst_layers: list[torch.Tensor],
                       src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    """sgl_kernel.kvcacheio.transfer_kv_direct: token rows `src_indices` of each source layer
    (tokens x heads x head_dim) into rows `dst_indices` of the matching destination layer."""
    src_rows, dst_rows = src_indices.long().cpu(), dst_indices.long().cpu()
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst.index_copy_(0, dst_rows, src.index_select(0, src_rows))


def transfer_kv_per_layer_direct_pf_lf(src_ptrs: list[torch.Tensor], dst_ptrs: list[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor,
                                       layer_id: int, page_size: int) -> None:
    """Host (page_first_direct: pages x layers x page_size x heads x head_dim, K and V)
    into one device layer (tokens x heads x head_dim): the load of layer `layer_id`."""
    src, dst_rows = src_indices.long().cpu(), dst_indices.long().cpu()
    for host, device in zip(src_ptrs, dst_ptrs, strict=True):
        device.index_copy_(0, dst_rows, host[src // page_size, layer_id, src % page_size])


def transfer_kv_all_layer_direct_lf_pf(src_ptrs: list[torch.Tensor], dst_ptrs: list[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor,
                                       page_size: int) -> None:
    """Every device layer (K layers, then V layers) into the host's page_first_direct
    K and V buffers: the backup of whole pages."""
    src_rows, dst = src_indices.long().cpu(), dst_indices.long().cpu()
    layers = len(src_ptrs) // len(dst_ptrs)
    for n, host in enumerate(dst_ptrs):
        part = src_ptrs[n * layers:(n + 1) * layers]
        host[dst // page_size, :, dst % page_size] = torch.stack([layer.index_select(0, src_rows)
                                                                  for layer in part], dim=1)


def _unpinned(init: Callable[..., None]) -> Callable[..., None]:
    signature = inspect.signature(init)

    def build(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["pin_memory"] = False
        init(*bound.args, **bound.kwargs)

    return build


def install() -> None:
    """The stand-ins, then the patches, in this process (idempotent)."""
    if any(isinstance(finder, StandIn) for finder in sys.meta_path):
        return
    check_version()
    from transformers.utils.import_utils import is_torchvision_available

    is_torchvision_available()  # cached: transformers has torchvision absent, stand-in or not
    sys.meta_path.insert(0, StandIn(STAND_INS))
    from sglang.srt.mem_cache.pool_host import base, mha

    base.HostKVCache.__init__ = _unpinned(base.HostKVCache.__init__)  # type: ignore[method-assign]
    mha.transfer_kv_direct = transfer_kv_direct
    mha.transfer_kv_per_layer_direct_pf_lf = transfer_kv_per_layer_direct_pf_lf
    mha.transfer_kv_all_layer_direct_lf_pf = transfer_kv_all_layer_direct_lf_pf
    torch.cpu.Stream.synchronize = lambda self: None  # type: ignore[attr-defined]


if __name__ in ("__main__", "__mp_main__"):
    install()

if __name__ == "__main__":  # what `python -m sglang.launch_server` does, less its deprecation warning
    import os

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    try:
        run_server(prepare_server_args(sys.argv[1:]))
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
