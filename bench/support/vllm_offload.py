"""vLLM's native tiered offloading on the CPU, driven as its scheduler drives it.

vLLM's `TieringOffloadingSpec` builds its `TieringOffloadingManager` in the scheduler: a
CPU tier over a real shared region (`/dev/shm/vllm_offload_ENGINE.mmap`) and the
secondary tiers its config names, loaded by its own factory (by `module_path` for
kvstore's). Only the GPU <-> CPU copies need CUDA; here `OffloadRig` does their part
itself, writing a stored chunk's bytes into its CPU-tier row as the swap worker would, and
reading a loaded chunk's row. Everything between the CPU tier and a secondary tier is
vLLM's and the tier's own code: the cascade of a store, the lookups (RETRY until a tier
answers), the promotion jobs, `get_finished_jobs`, each step's `on_schedule_end`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

TOKENS_PER_BLOCK = 16
T = TypeVar("T")
STEP_S = 0.002  # between scheduler steps while a rig waits for a tier


def kvstore_tier(store: dict[str, Any] | str, **options: Any) -> dict[str, Any]:
    """The `secondary_tiers` entry of kvstore's tier over the service `store` configures
    (its weights named "bench" unless `model_revision` says otherwise; None: fingerprinted)."""
    entry = {"type": "KVStoreTier", "module_path": "engine_plugin.vllm.tier", "config": store,
             "model_revision": "bench", **options}
    return {key: value for key, value in entry.items() if value is not None}


def native_offloading(store: str, cpu_bytes: int) -> str:
    """`--kv-transfer-config` of vLLM's own OffloadingConnector: a CPU tier of `cpu_bytes`
    over kvstore's tier, whose kvstore config is the file `store` (docs/vllm.md)."""
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_bytes,
             "secondary_tiers": [kvstore_tier(store, model_revision=None)]}
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": extra})


def fs_tier(root: str, threads: int = 16) -> dict[str, Any]:
    """The `secondary_tiers` entry of vLLM's own file-system tier under `root`."""
    return {"type": "fs", "root_dir": root, "n_read_threads": threads, "n_write_threads": threads}


def offloading_spec(tiers: Sequence[dict[str, Any]], row_bytes: int, rows: int, *,
                    model: str = "kvstore-bench", events: bool = False,
                    groups: int = 1) -> TieringOffloadingSpec:
    """vLLM's spec for one engine of `groups` KV cache groups (a layer each): a CPU tier of
    `rows` rows of `row_bytes` (a multiple of the page size) over the given secondary tiers."""
    config = OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(TOKENS_PER_BLOCK, (f"model.layers.{g}.self_attn",), g)
                     for g in range(groups)),
        worker_kv_bytes_per_block=row_bytes, enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": rows * row_bytes, "secondary_tiers": [dict(t) for t in tiers]},
        engine_id=f"kvstore-{uuid.uuid4().hex[:12]}", model=OffloadingModelConfig(model, "float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS_PER_BLOCK, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True),
        kv_cache_layout="NHD")
    return TieringOffloadingSpec(config)


def offload_key(name: str | int, group: int = 0) -> OffloadKey:
    """A made-up chunk's offload key: a SHA-256-sized block hash named by `name`."""
    import hashlib

    return make_offload_key(hashlib.sha256(f"block-{name}".encode()).digest(), group)


def payload(name: str | int, size: int) -> bytes:
    """Chunk `name`'s made-up bytes (the same in every process)."""
    seed = int.from_bytes(offload_key(name)[:8], "little")
    return np.random.default_rng(seed).bytes(size)


class OffloadRig:
    """One engine's TieringOffloadingManager, driven a request at a time: `store` as vLLM's
    swap worker and scheduler do after a prefill, `lookup` and `load` as they do when a
    request arrives. Each call steps the scheduler until the tiers have answered (at
    most `timeout_s`)."""

    def __init__(self, spec: TieringOffloadingSpec, timeout_s: float = 60.0) -> None:
        manager = spec.get_manager()
        assert isinstance(manager, TieringOffloadingManager)
        self.manager = manager
        self.rows = np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        self.row_bytes = self.rows.shape[1]
        self.timeout_s = timeout_s
        self.tier = manager.secondary_tiers[0]

    def context(self, req_id: str, keys: Sequence[OffloadKey]) -> ReqContext:
        """A request of these chunks, in order within each KV cache group (vLLM's scheduler
        records where each ends)."""
        context = ReqContext(req_id)
        self.manager.on_new_request(context)
        seen: dict[bytes, int] = {}
        for key in keys:
            group = key[-4:]
            seen[group] = seen.get(group, 0) + 1
            context.set_offload_key_position(key, seen[group] * TOKENS_PER_BLOCK)
        return context

    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext((), ()))

    def settle(self) -> None:
        """Step until no transfer is in flight (at most the rig's timeout)."""
        deadline = time.monotonic() + self.timeout_s
        self.step()
        while self.manager.has_pending_work() and time.monotonic() < deadline:
            time.sleep(STEP_S)
            self.step()

    def store(self, keys: Sequence[OffloadKey], payloads: Sequence[bytes], req_id: str = "store") -> int:
        """One request's chunks computed and offloaded: written into CPU-tier rows, then
        cascaded to the secondary tiers; returns once those jobs ended. The chunks the CPU
        tier took."""
        context = self.context(req_id, keys)
        prepared = self.manager.prepare_store(list(keys), context)
        taken = 0
        if prepared is not None and prepared.keys_to_store:
            spec = prepared.store_spec
            assert isinstance(spec, CPULoadStoreSpec)
            where = {key: i for i, key in enumerate(keys)}
            for key, row in zip(prepared.keys_to_store, spec.chunk_ids, strict=True):
                self.rows[int(row)] = np.frombuffer(payloads[where[key]], np.uint8)
            self.manager.complete_store(prepared.keys_to_store, context)
            taken = len(prepared.keys_to_store)
        self.manager.on_request_finished(context)
        self.settle()
        return taken

    def lookup(self, keys: Sequence[OffloadKey], context: ReqContext) -> list[LookupResult]:
        """Each chunk's lookup as the scheduler scans a prompt (past a MISS, not asked), asked
        again each step while any is RETRY or HIT_PENDING."""
        return self.promote([keys], [context])[0]

    def promote(self, requests: Sequence[Sequence[OffloadKey]],
                contexts: Sequence[ReqContext]) -> list[list[LookupResult]]:
        """Requests arriving together, looked up in each step as the scheduler does (their
        promotions go out as one job per request at the step's end) until every chunk is
        settled: HIT in the CPU tier or MISS (at most the rig's timeout)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            found = [self._scan(keys, context) for keys, context in zip(requests, contexts, strict=True)]
            unsettled = any(r in (LookupResult.RETRY, LookupResult.HIT_PENDING) for rs in found for r in rs)
            if not unsettled or time.monotonic() > deadline:
                return found
            self.step()
            time.sleep(STEP_S)

    def _scan(self, keys: Sequence[OffloadKey], context: ReqContext) -> list[LookupResult]:
        results: list[LookupResult] = []
        for key in keys:
            results.append(self.manager.lookup(key, context))
            if results[-1] is LookupResult.MISS:
                break
        return results

    def read(self, keys: Sequence[OffloadKey], found: Sequence[LookupResult], context: ReqContext,
             copy: Callable[[np.ndarray], T]) -> list[T | None]:
        """`copy` of each chunk's CPU-tier row where its lookup was a HIT (None elsewhere: vLLM
        recomputes it), the rows pinned meanwhile as for the swap worker's copy to the GPU."""
        hits = [key for key, result in zip(keys, found, strict=False) if result is LookupResult.HIT]
        loaded: list[T | None] = [None] * len(keys)
        if hits:
            spec = self.manager.prepare_load(hits, context)
            assert isinstance(spec, CPULoadStoreSpec)
            where = {key: i for i, key in enumerate(keys)}
            for key, row in zip(hits, spec.chunk_ids, strict=True):
                loaded[where[key]] = copy(self.rows[int(row)])
            self.manager.complete_load(hits, context)
        return loaded

    def finish(self, contexts: Sequence[ReqContext]) -> None:
        for context in contexts:
            self.manager.on_request_finished(context)
        self.settle()

    def load(self, keys: Sequence[OffloadKey], req_id: str = "load") -> list[bytes | None]:
        """A request of these chunks arrives: each chunk's bytes as the CPU tier then holds
        them (None: not there, vLLM recomputes it)."""
        context = self.context(req_id, keys)
        try:
            return self.read(keys, self.lookup(keys, context), context, lambda row: row.tobytes())
        finally:
            self.finish([context])

    def reset(self) -> None:
        """vLLM's reset_cache (a sleep, a weight update): the CPU tier empties, and each
        secondary tier drains (kvstore's then keys by a new generation: engine_plugin/vllm/tier.py)."""
        self.manager.reset_cache()

    def empty_cpu_tier(self) -> None:
        """The CPU tier forgets every chunk (as vLLM's reset empties it) while the secondary
        tiers keep theirs and their keys: what loads next comes from them. Between requests."""
        self.manager.primary_tier.reset_cache()

    def close(self) -> None:
        del self.rows
        self.manager.shutdown()
