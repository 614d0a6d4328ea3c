"""The connector's worker half, made when vLLM hands a worker its KV caches: the layout of
those caches (paged, or a hybrid model's groups), the rank's clients of the service (each
registered for DMA on a GPU), the device staging pool, and the worker core that loads,
saves and stages (core/worker_side.py). The scheduler half is scheduler_role.py."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from engine_plugin.vllm.core.device_staging import DeviceStagingPool
from engine_plugin.vllm.core.groups import GroupRules
from engine_plugin.vllm.core.options import ConnectorOptions
from engine_plugin.vllm.core.worker_side import WorkerCore
from engine_plugin.vllm.cpu_amx import ready_cpu_worker
from engine_plugin.vllm.cuda_host import register_for_dma
from engine_plugin.vllm.kv_groups import GroupedKVLayout
from engine_plugin.vllm.layout import PagedKVLayout
from engine_plugin.vllm.namespaces import EngineNamespaces
from kvstore.io.copier import share_with
from kvstore.io.streaming import streaming_thresholds, streaming_tunable
from kvstore.service.client import StoreClient

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("vllm.kvstore")


def make_worker(kv_caches: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig, blocks_per_chunk: int,
                rules: GroupRules | None, options: ConnectorOptions, namespaces: EngineNamespaces,
                fail_requests: bool) -> WorkerCore:
    """This rank's worker core over `kv_caches`, its CPU ready for loaded KV before any
    forward pass reads it."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    layout: PagedKVLayout | GroupedKVLayout
    if rules is None:
        layout = PagedKVLayout(kv_caches, kv_cache_config.num_blocks, blocks_per_chunk)
    else:
        layout = GroupedKVLayout(kv_caches, kv_cache_config, blocks_per_chunk)
    rank = get_tensor_model_parallel_rank()
    ready_cpu_worker(layout.device.type, rank)  # before any forward pass reads loaded KV
    namespace = namespaces("")[rank].digest()
    kv_dtype = namespaces.base.kv_dtype

    def make_client(map_tier: bool) -> StoreClient:
        client = StoreClient(options.store, layout.chunk_bytes, namespace=namespace,
                             dtype=kv_dtype, shape=(layout.chunk_bytes,), map_tier=map_tier)
        if layout.device.type == "cuda":
            register_for_dma(client.memory)  # unregistered when the client goes (a reconnect)
        return client

    staging = None
    if options.device_staging:
        staging = DeviceStagingPool(layout.chunk_bytes, options.device_staging, layout.device)
    worker = WorkerCore(layout, rank, make_client, staging, options.save_window_wait_s, fail_requests)
    log.info("kvstore worker rank %d: layout %s, %d bytes per chunk", rank, layout.describe(),
             layout.chunk_bytes)
    on_cpu = layout.device.type == "cpu"
    if on_cpu and options.load_copy_cpus:  # the operator's: CPUs no engine thread needs
        share_with(options.load_copy_cpus)
        log.info("kvstore worker rank %d: a load's copies run on CPUs %s besides this worker's %s", rank,
                 ",".join(map(str, options.load_copy_cpus)), sorted(os.sched_getaffinity(0)))
    tunable = streaming_tunable(layout.smallest_copy, streaming_thresholds()) if on_cpu else None
    if tunable is not None:  # the thresholds are the process's from its start: only vLLM's user can set them
        log.info("kvstore worker rank %d: a load copies pieces of %d bytes that do not stream under "
                 "this process's glibc thresholds: start vLLM with GLIBC_TUNABLES=%s for faster loads "
                 "(docs/vllm.md)", rank, layout.smallest_copy, tunable)
    return worker
