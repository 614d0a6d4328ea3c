"""TieredKVConnector: kvstore behind vLLM's KV connector interface (v1).

vLLM creates one instance with role SCHEDULER (in the engine-core process) and one
with role WORKER per tensor-parallel rank (in each worker process); each hook hands over
to its half, the scheduler's (scheduler_role.py) or a worker's (worker_role.py). They
share no Python objects: both talk to the per-host kvstore service
(kvstore/service/server.py), the scheduler for lookups, the workers for loads and saves. vLLM carries this
step's plan (engine_plugin.vllm.core.plan.StepPlan) from one to the others.

Workers report each save done through vLLM's worker metadata; the scheduler holds a
request whose prefix is still being saved (engine_plugin/vllm/core/scheduler_side.py). A load that
fails is recomputed: its blocks are reported, or with several KV cache groups (block ids
unique only within a group) its request, loaded async (kv_groups.failures_per_request).

vLLM calls the scheduler hooks on its scheduler thread, where an exception ends the
engine. So each is guarded (SchedulerRole.guard): a fault in kvstore is counted
(`connector.faults`), logged once per hook, and is a miss for that request
(SchedulerCore.abandon: a load planned for it is given up whole, recomputed by the
engine); build_connector_meta always returns a plan.

`kv_role` (engine_plugin/vllm/core/handoff.py): kv_both saves and loads; kv_producer also returns, in
`kv_transfer_params`, the prompt chunks it stored, and a consumer given them waits for
those chunks before loading (prefill/decode disaggregation, docs/pd.md); kv_consumer
saves nothing unless `pd_consumer_saves`.

Turn it on with
  --kv-transfer-config '{"kv_connector":"TieredKVConnector","kv_role":"kv_both",
                         "kv_connector_extra_config":{"config":"kvstore.yaml"}}'
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from engine_plugin.vllm.core.handoff import Role, check_producer_store
from engine_plugin.vllm.core.hints import HintLimits
from engine_plugin.vllm.core.options import check_chunk_size, parse_options
from engine_plugin.vllm.core.plan import StepPlan
from engine_plugin.vllm.core.scheduler_side import SchedulerCore
from engine_plugin.vllm.core.worker_side import WorkerCore
from engine_plugin.vllm.kv_groups import describe_groups, failures_per_request, group_rules
from engine_plugin.vllm.namespaces import EngineNamespaces
from engine_plugin.vllm.scheduler_role import SchedulerRole
from engine_plugin.vllm.worker_role import make_worker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvstore")
_MISS: tuple[int | None, bool] = (0, False)  # what a guarded lookup answers after a fault
# The tiers a hit's tokens came from (RequestState.sources), as vLLM names them.
HIT_SOURCES = {"dram": CacheHitSource.HOST, "disk": CacheHitSource.DISK}


@dataclass
class TieredMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class TieredWorkerMetadata(KVConnectorWorkerMetadata):
    """Saves the workers finished this step, the plans whose sync loads they carried out
    (one entry per rank for each), and their counters for the service (summed)."""

    done_saves: list[int] = field(default_factory=list)
    loaded_steps: list[int] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TieredWorkerMetadata)
        self.done_saves.extend(other.done_saves)
        self.loaded_steps.extend(other.loaded_steps)
        self.counters = dict(Counter(self.counters) + Counter(other.counters))
        return self


class TieredKVConnector(KVConnectorBase_V1, SupportsHMA):
    """SupportsHMA: vLLM keeps its hybrid KV cache manager on, and a hybrid model's KV
    cache groups are each stored as vLLM keeps them (engine_plugin/vllm/kv_groups.py)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.options = parse_options(self._kv_transfer_config.kv_connector_extra_config)
        store = self.options.store
        self.block_size = vllm_config.cache_config.block_size
        self.blocks_per_chunk = check_chunk_size(store.chunk_tokens, self.block_size)
        # kvstore is a cache: a chunk that fails to load is recomputed, never fatal.
        self._kv_transfer_config.kv_load_failure_policy = "recompute"
        self._store_role = Role.of(self._kv_transfer_config.kv_role, self.options.pd_consumer_saves)
        check_producer_store(self._store_role, store)
        self._rules = group_rules(kv_cache_config, store.chunk_tokens, self.block_size,
                                  self.options.sliding_window_interval)
        self.options, self._fail_requests = failures_per_request(self.options, kv_cache_config)
        scheduler = role == KVConnectorRole.SCHEDULER
        self._namespaces = EngineNamespaces.of_engine(vllm_config, kv_cache_config, self.options, self._rules,
                                                      name_weights=scheduler)
        self._kv_dtype = self._namespaces.base.kv_dtype
        self._scheduler: SchedulerCore | None = None
        self._worker: WorkerCore | None = None
        self._role_side: SchedulerRole | None = None
        if scheduler:
            events = vllm_config.kv_events_config
            model = vllm_config.model_config
            # Under vLLM's external launcher each process schedules for its own worker alone.
            alone = vllm_config.parallel_config.distributed_executor_backend == "external_launcher"
            self._role_side = SchedulerRole(self.options, self.block_size, self._namespaces, self._rules,
                                            self._store_role.saves,
                                            events is not None and events.enable_kv_cache_events,
                                            HintLimits(model.max_model_len, model.get_vocab_size()),
                                            reporting_workers=1 if alone else 0)
            self._scheduler = self._role_side.core
        log.info("kvstore connector (%s, %s): chunk %d tokens, KV cache groups: %s (%s), socket %s",
                 role.name, self._store_role.name, store.chunk_tokens, describe_groups(kv_cache_config),
                 self._kv_dtype, store.service.socket)

    def reset_cache(self) -> bool:
        """vLLM resets its prefix cache with the connector's (after a weight update:
        `reset_prefix_cache(reset_connector=True)`, the server's `?reset_external=true`):
        this engine's namespaces start a new generation, so nothing stored before is loaded
        by it again. Nothing is deleted: the store is shared, and other engines may still
        run the old weights (`kvstore purge` removes a generation's records)."""
        def reset() -> bool:
            weights = self._namespaces.new_generation()
            self._side().core.forget_lookups()
            log.info("kvstore: new generation %s of %s's namespaces (weights %s)", weights.generation,
                     self._namespaces.base.model, weights.fingerprint)
            return True

        return self._side().guard("reset_cache", None, reset, fallback=False)

    # -- scheduler side ----------------------------------------------------------------

    def _side(self) -> SchedulerRole:
        assert self._role_side is not None, "a scheduler hook called on a worker's connector"
        return self._role_side

    def on_new_request(self, request: Request) -> None:
        self._side().guard("on_new_request", request.request_id, self._side().arrive, request, fallback=None)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        side = self._side()
        return side.guard("get_num_new_matched_tokens", request.request_id, side.matched_tokens,
                          request, num_computed_tokens, fallback=_MISS)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """What the workers report: saves done, failed loads (SchedulerRole.workers_reported)."""
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, TieredWorkerMetadata):
            meta = TieredWorkerMetadata()
        self._side().guard("update_connector_output", None, self._side().workers_reported, meta.done_saves,
                           connector_output.failed_recving, connector_output.invalid_block_ids,
                           connector_output.finished_recving or (), meta.loaded_steps, meta.counters,
                           fallback=None)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        block_ids = blocks.get_block_ids()
        # A hit whose load fails to be planned is given up on every block of the request:
        # the engine recomputes it all rather than read blocks never filled.
        self._side().guard("update_state_after_alloc", request.request_id, self._scheduler.on_alloc,
                           request.request_id, block_ids, num_external_tokens, fallback=None,
                           blocks=block_ids if num_external_tokens else ())

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        """vLLM's hit metrics by source: what was in DRAM at the lookup is vLLM's `host` (host
        memory), the rest `disk`."""
        assert self._scheduler is not None
        split: dict[str, int] = self._side().guard("get_external_cache_hit_sources", None,
                                                   self._scheduler.hit_sources, request.request_id,
                                                   num_external_tokens, fallback={})
        return {HIT_SOURCES[tier]: tokens for tier, tokens in split.items()}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's plan; a request whose bookkeeping faults is abandoned, the others go on."""
        assert self._scheduler is not None
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._side().guard("build_connector_meta", new.req_id, self._scheduler.on_scheduled, new.req_id,
                               new.block_ids, True, new.num_computed_tokens + scheduled.get(new.req_id, 0),
                               fallback=None)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self._side().guard("build_connector_meta", req_id, self._scheduler.on_scheduled, req_id,
                               cached.new_block_ids[i] or None, req_id in cached.resumed_req_ids,
                               cached.num_computed_tokens[i] + scheduled.get(req_id, 0), fallback=None)
        return TieredMetadata(plan=self._scheduler.take_plan())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """kvstore's chunks entering and leaving its tiers, for KV-aware routers."""
        events = self._role_side.router_events if self._role_side is not None else None
        return self._side().guard("take_events", None, events.take, fallback=()) if events is not None else ()

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Blocks can be freed at once: saves copy chunks out within their step. A
        producer's reply names the prompt chunks it stored (SchedulerRole.finished)."""
        cluster = self.options.store.cluster
        params = self._side().guard("request_finished", request.request_id, self._side().finished, request,
                                    self._store_role, cluster.host_id if cluster is not None else None,
                                    fallback=None)
        return False, params

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """SupportsHMA's request_finished, with every group's blocks: the same answer."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # -- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker = make_worker(kv_caches, self._kv_cache_config, self.blocks_per_chunk, self._rules,
                                   self.options, self._namespaces, self._fail_requests)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._plan()
        if self._worker is not None and plan.stages:
            self._worker.start_stages(plan.stages)
        if self._worker is not None and plan.loads:
            self._worker.start_loads(plan.loads, plan.step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads fill whole chunks (all layers) before the request runs."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Saves take whole chunks after the step (wait_for_save), not layer by layer."""

    def wait_for_save(self) -> None:
        plan = self._plan()
        if self._worker is not None and plan.saves:
            self._worker.save(plan.saves)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done, failed = self._worker.take_finished_loads() if self._worker is not None else (set(), set())
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        meta = TieredWorkerMetadata(self._worker.take_done_saves(), self._worker.take_loaded_steps(),
                                    self._worker.take_counters())
        return meta if meta.done_saves or meta.loaded_steps or meta.counters else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._role_side is not None:
            self._role_side.link.close()

    def _plan(self) -> StepPlan:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, TieredMetadata)
        return metadata.plan
