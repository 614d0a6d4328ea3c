"""kvstore as a secondary tier of vLLM's own tiered KV offloading.

vLLM's native offloading (`OffloadingConnector` with `TieringOffloadingSpec`) keeps a CPU
tier and, below it, secondary tiers it loads by module path from its offloading config
(docs/vllm.md, "kvstore inside vLLM's own offloading"):

    "secondary_tiers": [{"type": "KVStoreTier", "module_path": "engine_plugin.vllm.tier",
                         "config": "kvstore.yaml"}]

A chunk of vLLM's CPU tier (one row of its shared region: every worker's bytes of
`blocks_per_chunk` blocks) is one kvstore chunk. vLLM's manager runs in the scheduler and
calls this tier there; nothing here blocks it: lookups are answered from residency
snapshots the service gives on a thread of their own (engine_plugin/vllm/core/tier_lookups.py: HIT,
MISS, or RETRY while the answer or the run's promotion to DRAM is awaited), and stores
and loads are jobs between the CPU tier's rows and the service on threads of their own
(engine_plugin/vllm/core/tier_jobs.py over connectors/page_io.py), collected by `get_finished_jobs`.

Keys: vLLM's offload key (the block hash of a chunk's last block, which chains the
prompt's tokens from its start with each block's images, LoRA adapter and cache salt,
and the KV cache group) is hashed with the group's kvstore namespace (model, a
fingerprint of the weights or `model_revision`, KV dtype, the row's layout, the group)
into kvstore's 16-byte key (key_digest); the weights' generation is new after each of
vLLM's cache resets (a weight update may keep the files: `drain_jobs`). Only SHA-256
block hashes are taken (vLLM's `prefix_caching_hash_algo` sha256 or sha256_cbor, its
default): a key of any other shape is a miss, counted as `malformed.offload_key`, and
never reaches the service.

Everything kvstore promises holds here: a record that does not verify is a miss (the
load reports the chunk failed and vLLM recomputes it), the tiers are bounded, a restart
finds what was written, engines on one host (and hosts on one array) share the store,
and a stopped or hung service costs misses within the lookup and I/O deadlines.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import secrets
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from connectors.link import ServiceLink
from connectors.page_io import Segments, service_pages
from connectors.weights import weights_identity
from engine_plugin.vllm.core.chain_reports import ChainReports
from engine_plugin.vllm.core.options import ConnectorOptions, parse_options
from engine_plugin.vllm.core.service_lane import ServiceLane
from engine_plugin.vllm.core.tier_jobs import Chain, TierJobs
from engine_plugin.vllm.core.tier_lookups import TierLookups, Verdict
from engine_plugin.vllm.request_keys import model_weights
from kvstore.format.errors import ConfigError
from kvstore.format.keys import KVNamespace, Shard, Weights, key_digest
from kvstore.service.client import StoreClient
from kvstore.service.client_types import RequestEnd

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger("vllm.kvstore")

BLOCK_HASH_BYTES = 32  # SHA-256: vLLM's sha256 and sha256_cbor prefix-caching hashes
KEY_TAG = b"vllm-offload-key"  # opens a tier key's hash input
# The connector's keys that mean the same here; the rest are the connector's own.
TIER_KEYS = {"config", "model_id", "model_revision", "lookup_timeout_s", "prefetch", "prefetch_policy",
             "prefetch_max_wait_s", "prefetch_timeout_s_per_1k_tokens"}
LOADERS = 2  # load jobs side by side, each on a connection of its own (one's reads, the other's copy)
ASK_DEADLINES = 3  # a lookup unanswered for this many lookup deadlines is a miss
CHORES_WAITING = 64  # best effort requests that may wait for the service; past it one is dropped
EVENTS_KEPT = 1 << 14  # chunks whose vLLM keys the tier remembers for its events
MEDIA = {"kvstore-dram": (Medium.CPU, Locality.LOCAL), "kvstore-disk": (Medium.STORAGE, Locality.LOCAL),
         "kvstore-nvmeof": (Medium.STORAGE, Locality.REMOTE)}  # the array every host reads


def tier_options(options: Mapping[str, Any]) -> ConnectorOptions:
    """The tier's options: the connector's keys that apply to a tier (TIER_KEYS; the
    kvstore config under `config`, or its keys at the top level)."""
    refused = sorted(set(options) & (ConnectorOptions.written_keys() - TIER_KEYS))
    if refused:
        raise ConfigError(refused[0], options[refused[0]],
                          "is an option of the TieredKVConnector; the tier takes "
                          + ", ".join(sorted(TIER_KEYS)))
    return parse_options(dict(options))


def row_layout(config: OffloadingConfig, row_bytes: int) -> str:
    """What fixes the bytes of one CPU-tier row besides the model: the KV layout, the
    parallelism whose workers' bytes a row holds, and the row's geometry."""
    parallel = config.parallel
    parts = [f"vllm-offload-row:{row_bytes}", f"layout:{config.kv_cache_layout}",
             f"tp:{parallel.tp_size}", f"pp:{parallel.pp_size}", f"pcp:{parallel.pcp_size}",
             f"dcp:{parallel.dcp_size}", f"block:{config.worker_kv_bytes_per_block}",
             f"chunk:{config.cache.blocks_per_chunk}", f"hash:{config.cache.tokens_per_hash}"]
    parts += ["replicated"] if config.replicated_layout else []
    parts += ["canonical"] if config.canonical_layout else []
    return "|".join(parts)


def tier_weights(model: str, model_revision: str | None) -> Weights:
    """The weights' identity (connectors/weights.py). vLLM's offloading config names the
    model, not the Hugging Face revision vLLM loaded of it nor what vLLM does to its weights
    (request_keys.py: numerics): vLLM's own config, where it is current here, says both;
    else a Hugging Face id needs `model_revision` (the snapshot `main` names may not be the
    weights vLLM runs, and two revisions must not share KV)."""
    from vllm.config import get_current_vllm_config_or_none

    current = get_current_vllm_config_or_none()
    if current is not None and current.model_config is not None and current.model_config.model == model:
        return Weights(model_weights(current, model_revision))  # its revision, quantization, dtype
    if model_revision:
        return Weights(weights_identity(model, model_revision))
    if not os.path.exists(model):
        raise ConfigError("model_revision", None, f"{model} is not a local checkpoint and vLLM's "
                                                  "revision of it is not known here: name its weights "
                                                  "with model_revision")
    return Weights(weights_identity(model, None))


def group_namespaces(config: OffloadingConfig, options: ConnectorOptions,
                     row_bytes: int) -> dict[int, KVNamespace]:
    """Each offloaded KV cache group's namespace, by vLLM's group id (a model of one group:
    no group in its namespace)."""
    model = options.model_id or config.model.name
    weights = tier_weights(config.model.name, options.model_revision)
    base = KVNamespace(model, config.model.dtype, row_layout(config, row_bytes),
                       config.cache.blocks_per_chunk * config.groups[0].tokens_per_block, weights=weights)
    if len(config.groups) == 1:
        return {config.groups[0].group_id: base}
    return {group.group_id: dataclasses.replace(base, shard=Shard(group=(
        f"{group.group_id}:{group.tokens_per_block}:{key_digest(chr(0).join(group.layer_names).encode()).hex()}")))
        for group in config.groups}


class TierKeys:
    """vLLM's offload keys as kvstore keys, and back for the chunks it saw last (its events)."""

    def __init__(self, namespaces: Mapping[int, KVNamespace]) -> None:
        self.namespaces = dict(namespaces)
        self._digests = {group: namespace.digest() for group, namespace in namespaces.items()}
        self._seen: OrderedDict[bytes, OffloadKey] = OrderedDict()

    def new_generation(self) -> Weights:
        """Every group's namespace under the same weights' fingerprint and a fresh random
        generation (engine_plugin/vllm/namespaces.py): no key made before is made again."""
        some = next(iter(self.namespaces.values()))
        weights = Weights(some.weights.fingerprint, secrets.token_hex(8))
        self.namespaces = {group: dataclasses.replace(namespace, weights=weights)
                           for group, namespace in self.namespaces.items()}
        self._digests = {group: namespace.digest() for group, namespace in self.namespaces.items()}
        return weights

    def of(self, key: object) -> bytes | None:
        """kvstore's key, or None for anything but a SHA-256 block hash of a group offloaded here."""
        if not isinstance(key, bytes) or len(key) != BLOCK_HASH_BYTES + 4:
            return None
        digest = self._digests.get(get_offload_group_idx(OffloadKey(key)))
        if digest is None:
            return None
        ours = key_digest(KEY_TAG, digest, get_offload_block_hash(OffloadKey(key)))
        self._seen[ours] = OffloadKey(key)
        self._seen.move_to_end(ours)
        if len(self._seen) > EVENTS_KEPT:
            self._seen.popitem(last=False)
        return ours

    def digest(self, key: OffloadKey) -> bytes:
        return self._digests[get_offload_group_idx(key)]

    def vllm_key(self, ours: bytes) -> OffloadKey | None:
        return self._seen.get(ours)


class Rows:
    """vLLM's CPU-tier region as pages: row r is `row_bytes` at base + r x row_bytes. Only
    the address is kept (no buffer export: vLLM unmaps the region after the tier shuts down)."""

    def __init__(self, view: memoryview) -> None:
        array = np.asarray(view)
        self.count, self.row_bytes = array.shape[0], array.strides[0]
        self.base = int(array.ctypes.data)
        del array

    def page(self, row: int) -> Segments | None:
        """Row `row`'s memory, or None for a row outside the region."""
        if not 0 <= row < self.count:
            return None
        return [(self.base + row * self.row_bytes, self.row_bytes)]


class RequestChains:
    """Each request's chunks (kvstore keys by group and end token) as the tier saw them: a
    store's parents, and what a request's end tells the service (engine_plugin/vllm/core/chain_reports.py)."""

    def __init__(self, reports: ChainReports) -> None:
        self.reports = reports
        self._chains: dict[str, dict[int, dict[int, bytes]]] = {}
        self._planned: dict[str, tuple[int, float | None]] = {}
        self._stored: dict[str, set[bytes]] = {}

    def saw(self, req_id: str, group: int, tokens: int | None, key: bytes) -> None:
        if tokens is not None:
            self._chains.setdefault(req_id, {}).setdefault(group, {})[tokens] = key

    def parent(self, req_id: str, group: int, tokens: int | None) -> bytes | None:
        """The key of the request's nearest earlier chunk the tier saw (None: the chain starts)."""
        chain = self._chains.get(req_id, {}).get(group, {})
        earlier = [t for t in chain if tokens is not None and t < tokens]
        return chain[max(earlier)] if earlier else None

    def stored(self, req_id: str, keys: Iterable[bytes]) -> None:
        if req_id not in self._planned:
            chain = self._chains.get(req_id, {})
            first = chain[min(chain)] if chain else {}
            self._planned[req_id] = self.reports.planned([first[t] for t in sorted(first)])
        self._stored.setdefault(req_id, set()).update(keys)

    def ended(self, req_id: str) -> None:
        """Tell how a request that stored chunks ended (its prompt's length is what the
        tier knows: the furthest chunk it saw; its answer's is not given to a tier)."""
        chains, stored = self._chains.pop(req_id, {}), self._stored.pop(req_id, set())
        planned = self._planned.pop(req_id, None)
        if planned is None or not chains:
            return
        ranks = [[chain[t] for t in sorted(chain) if chain[t] in stored]
                 for _, chain in sorted(chains.items())]
        tokens = max(max(chain) for chain in chains.values())
        self.reports.ended([rank for rank in ranks if rank], tokens, tokens, planned)


class TierEvents:
    """The service's chunk events (kvstore/service/chunk_events.py) about chunks this tier
    stored or looked up, as vLLM's OffloadingEvents owned by this tier: a chunk entering or
    leaving kvstore's DRAM (Medium.CPU, local), its disk (STORAGE, local) or the NVMe-oF
    array every host of a cluster reads (STORAGE, REMOTE). Asked once a step on the tier's
    best effort lane; a failure (or a full lane) costs events, never the step."""

    def __init__(self, keys: TierKeys, lane: ServiceLane, ownership: str) -> None:
        self.keys, self.lane, self.ownership = keys, lane, ownership
        self.cursor = -1  # the first answer says where the log is: what came before is not news
        self._asked: Future[tuple[int, int, list[tuple[bool, bytes, str]]] | None] | None = None
        self._ready: list[OffloadingEvent] = []
        self._translate(lane.submit(lambda client: client.events(-1)).result())  # at start-up, once

    def ask(self) -> None:
        """Take the last answer if it is in, and ask for what came since."""
        if self._asked is not None:
            if not self._asked.done():
                return
            self._translate(self._asked.result())
        cursor = self.cursor
        self._asked = self.lane.submit(lambda client: client.events(cursor))

    def _translate(self, answer: tuple[int, int, list[tuple[bool, bytes, str]]] | None) -> None:
        if answer is None:
            return
        self.cursor, _, events = answer
        runs: list[tuple[bool, str, list[OffloadKey]]] = []  # in the log's order, alike ones together
        for stored, ours, medium in events:
            key = self.keys.vllm_key(ours)
            if key is None or medium not in MEDIA:
                continue
            if runs and runs[-1][:2] == (stored, medium):
                runs[-1][2].append(key)
            else:
                runs.append((stored, medium, [key]))
        for stored, medium, keys in runs:
            where, locality = MEDIA[medium]
            self._ready.append(OffloadingEvent(keys, where, removed=not stored, locality=locality,
                                               ownership=self.ownership))

    def take(self) -> list[OffloadingEvent]:
        ready, self._ready = self._ready, []
        return ready


@dataclasses.dataclass
class _Job:
    keys: list[OffloadKey]  # the chunks handed to the job, in its order
    skipped: list[OffloadKey]  # chunks it could not take (a key or row refused): failed
    req_id: str
    load: bool


class KVStoreTier(SecondaryTierManager):
    """vLLM's SecondaryTierManager over the kvstore service. Its options (the tier's
    entry in `secondary_tiers`, beside `type` and `module_path`): the connector's keys in
    TIER_KEYS (`config` required), `enable_kv_events` and `locality` as vLLM's `fs` tier."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: BackpressureDetector | None = None, **options: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        locality, events = options.pop("locality", None), options.pop("enable_kv_events", False)
        self.locality = Locality(locality) if locality is not None else None
        parsed = tier_options(options)
        self.rows = Rows(primary_kv_view)
        config = offloading_spec.config
        self.keys = TierKeys(group_namespaces(config, parsed, self.rows.row_bytes))
        described = [(ns.digest(), ns.description()) for ns in self.keys.namespaces.values()]
        reads, writes = service_pages(parsed.store, "config", self.rows.row_bytes, *described[0],
                                      more=described[1:])
        self.jobs = TierJobs([reads, *(reads.another() for _ in range(LOADERS - 1))], writes)
        links = [ServiceLink(lambda: StoreClient(parsed.store, timeout_s=parsed.lookup_timeout_s))
                 for _ in range(2)]
        for link in links:
            link.start()
        self.lookups = TierLookups(links[0], parsed.prefetch, ASK_DEADLINES * parsed.lookup_timeout_s)
        # Counters, request ends, touches, event polls: never ahead of a lookup, never a backlog.
        self.chores = ServiceLane(links[1], "kvstore-tier-chores", most=CHORES_WAITING)
        self.chains = RequestChains(ChainReports(self._notify, config.cache.blocks_per_chunk
                                                 * config.groups[0].tokens_per_block))
        enabled = events and offloading_spec.kv_events_config.enable_kv_cache_events
        self.events = TierEvents(self.keys, self.chores, tier_type) if enabled else None
        self.counters: Counter[str] = Counter()
        self._jobs: dict[int, _Job] = {}
        self._warned = False

    # -- lookups and requests -----------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        ours = self._ours(key)
        if ours is None:
            return LookupResult.MISS
        tokens, group = req_context.get_offload_key_position(key), get_offload_group_idx(key)
        self.chains.saw(req_context.req_id, group, tokens, ours)
        verdict = self.lookups.verdict(req_context.req_id, ours, tokens or 0, group)
        return {Verdict.HIT: LookupResult.HIT, Verdict.MISS: LookupResult.MISS,
                Verdict.WAIT: LookupResult.RETRY}[verdict]

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Recently used: the service touches each group's run of them (and promotes its disk
        part to DRAM)."""
        runs: dict[int, list[bytes]] = {}
        for key in keys:
            if (ours := self._ours(key)) is not None:
                runs.setdefault(get_offload_group_idx(key), []).append(ours)
        for run in runs.values():
            self.chores.submit(functools.partial(StoreClient.residency, keys=run, prefetch=True))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.chains.ended(req_context.req_id)
        self.lookups.forget(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.lookups.flush()
        if self.events is not None:
            self.events.ask()
        self.counters.update(self.lookups.tracker.take_counters())
        if dropped := self.chores.take_dropped():
            self.counters["tier.requests_dropped"] += dropped
        if self.counters:
            counted, self.counters = dict(self.counters), Counter()
            self.chores.submit(lambda client: client.count(counted))

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self.events.take() if self.events is not None else ()

    def has_pending_work(self) -> bool:
        return self.jobs.pending() or self.lookups.pending()

    def _ours(self, key: object) -> bytes | None:
        ours = self.keys.of(key)
        if ours is None:
            self.counters["malformed.offload_key"] += 1
            if not self._warned:
                self._warned = True
                log.warning("kvstore tier: an offload key that is not a SHA-256 block hash of a group "
                            "offloaded here (vLLM's prefix_caching_hash_algo must be sha256 or "
                            "sha256_cbor) is a miss (counted as malformed.offload_key; logged once)")
        return ours

    def _notify(self, kind: str, ranks: list[list[bytes]], in_s: float, /,
                end: RequestEnd | None = None) -> None:
        self.chores.submit(lambda client: client.finished(ranks, end))

    # -- jobs ---------------------------------------------------------------------------

    def _chunks(self, job: TransferJob) -> tuple[list[tuple[OffloadKey, bytes, Segments]], list[OffloadKey]]:
        """The job's (vLLM key, kvstore key, page) for each chunk it may move, and the rest."""
        usable, skipped = [], []
        for key, row in zip(job.keys, job.chunk_ids, strict=True):
            ours, page = self._ours(key), self.rows.page(int(row))
            if ours is None or page is None:
                skipped.append(key)
            else:
                usable.append((key, ours, page))
        return usable, skipped

    def submit_store(self, job_metadata: TransferJob) -> None:
        """One chain per KV cache group, in token order, under the request's chunk before it."""
        context = job_metadata.req_context
        usable, skipped = self._chunks(job_metadata)
        groups: dict[int, list[tuple[int | None, OffloadKey, bytes, Segments]]] = {}
        for key, ours, page in usable:
            tokens = context.get_offload_key_position(key)
            self.chains.saw(context.req_id, get_offload_group_idx(key), tokens, ours)
            groups.setdefault(get_offload_group_idx(key), []).append((tokens, key, ours, page))
        chains, order = [], []
        for group, chunks in sorted(groups.items()):
            chunks.sort(key=lambda chunk: (chunk[0] is None, chunk[0] or 0))
            parent = self.chains.parent(context.req_id, group, chunks[0][0])
            chains.append(Chain([c[2] for c in chunks], [c[3] for c in chunks], parent,
                                self.keys.digest(chunks[0][1])))
            order += [c[1] for c in chunks]
        self.chains.stored(context.req_id, [ours for chain in chains for ours in chain.keys])
        self._jobs[job_metadata.job_id] = _Job(order, skipped, context.req_id, load=False)
        self.jobs.store(job_metadata.job_id, chains)

    def submit_load(self, job_metadata: TransferJob) -> None:
        usable, skipped = self._chunks(job_metadata)
        self._jobs[job_metadata.job_id] = _Job([c[0] for c in usable], skipped,
                                               job_metadata.req_context.req_id, load=True)
        self.jobs.load(job_metadata.job_id, [c[1] for c in usable], [c[2] for c in usable])

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for ended in self.jobs.finished():
            job = self._jobs.pop(ended.job_id)
            loaded = [key for key, ok in zip(job.keys, ended.done, strict=True) if ok]
            failed = [key for key, ok in zip(job.keys, ended.done, strict=True) if not ok] + job.skipped
            if job.load and failed:
                self.counters["load.failed_chunks"] += len(failed)
                self.lookups.missed(job.req_id, [k for k in map(self.keys.of, failed) if k is not None])
            results.append(JobResult(ended.job_id, success=not failed,
                                     successful_keys=tuple(loaded) if job.load and failed else None,
                                     transfer_time=ended.seconds,
                                     transfer_bytes=len(loaded) * self.rows.row_bytes))
        return results

    def drain_jobs(self) -> None:
        """vLLM drains its tiers when it resets its caches: at sleep, wake-up and a weight
        update (`reset_prefix_cache(reset_connector=True)`), leaving secondary tiers' data
        alone. Weights updated in place keep their checkpoint's fingerprint, so once the
        jobs have ended this tier's namespaces start a new generation, as the connector's
        `reset_cache` does: nothing stored before is loaded by this engine again (a reset
        without new weights costs those hits). Nothing is deleted: other engines may run
        the old weights (`kvstore purge` removes a generation)."""
        self.jobs.drain()
        weights = self.keys.new_generation()
        self.lookups.forget_all()
        described = [(ns.digest(), ns.description()) for ns in self.keys.namespaces.values()]
        self.chores.submit(lambda client: client.announce(described))  # so `kvstore purge` lists them
        log.info("kvstore tier: new generation %s of %s's namespaces (weights %s)", weights.generation,
                 next(iter(self.keys.namespaces.values())).model, weights.fingerprint)

    def shutdown(self) -> None:
        """Jobs end (within the service's deadlines), then the threads and connections go
        (best effort requests still waiting are dropped)."""
        self.jobs.close()
        self.lookups.close()
        self.chores.close()
