"""SGLang's HiCache storage tier ("L3") backed by the per-host kvstore service.

SGLang loads it with configuration only (docs/sglang.md):

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "kvstore", "module_path": "engine_plugin.sglang.hicache",
      "class_name": "KVStoreHiCache", "interface_v1": 1, "config": "kvstore.yaml"}'

One SGLang page is one kvstore chunk. With `interface_v1` SGLang calls the zero-copy
`batch_get_v1`/`batch_set_v1` with host-pool indices: a page's bytes are copied once,
between the service (its mapped DRAM tier or this client's window) and the page's place
in the host pool that `register_mem_pool_host` handed over (connectors/page_io.py).
Without it SGLang uses the older tensor calls, `batch_get`/`batch_set`. Both store the
same bytes: the pool's flat page (`get_data_page`), all K then all V.

Keys: SGLang's page hash plus what the page's bytes depend on, hashed into kvstore's
16-byte key: the model, its weights (`model_revision` in the extra config, else a
fingerprint of the checkpoint at SGLang's model path: connectors/weights.py), what SGLang
does to them (`served_weights`: its quantization, KV cache format and compute dtype,
config overrides, mamba state dtype) and their generation, the host pool's layout and
dtype, and the shard. SGLang's page hash itself
chains the page's token ids from the prompt's start, seeded with the request's extra key
(its LoRA id) and cache salt, and an image's tokens are stand-ins derived from the
image's content: so a key covers images, LoRA and salt as SGLang's own cache does (input
embeddings never reach HiCache: SGLang refuses them with its radix cache on). MHA KV is
split across tensor-parallel ranks, so each rank's pages are keyed apart; MLA KV is the
same on every rank, so the ranks share one key and only SGLang's storage writer stores it.

`clear()` (SGLang's `POST /hicache/storage-backend/clear`) starts a new generation of the
weights: a random nonce in every key, so nothing this backend stored before is found by
it again; nothing is deleted (the store is shared; `kvstore purge` removes a generation).

A hybrid model's further host pools (Mamba state, sliding-window KV, a DSA indexer) come
through SGLang's v2 calls (`register_mem_host_pool_v2`, `batch_exists_v2`,
`batch_get_v2`, `batch_set_v2`); engine_plugin/sglang/pools.py keys and moves their pages.

This module imports SGLang (the class must subclass its HiCacheStorage); nothing in
kvstore/ or connectors/ imports it.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from connectors.page_io import PageIO, Segments, service_pages
from connectors.weights import numerics, overrides_digest, weights_identity
from engine_plugin.sglang.pools import HybridPools, flat_ints, shard_suffix
from kvstore.config.store import StoreConfig, load_config
from kvstore.format.errors import ConfigError
from kvstore.format.keys import Weights, key_digest

log = logging.getLogger("kvstore.sglang")


REOPEN_S = 5.0  # the least time between tries to connect again after one failed

def served_weights(storage_config: HiCacheStorageConfig, model_revision: str | None) -> str:
    """The weights' identity (connectors/weights.py) of what SGLang serves. SGLang hands
    the backend its served model name (`--served-model-name`, often not a path), so the
    server's own arguments are read where this process has them (a server's scheduler):
    its `model_path` at its `--revision` (a Hugging Face id: the local snapshot at that
    revision), and what it does to those files besides (`numerics`, each as SGLang resolved
    it): `--quantization`, `--modelopt-quant`; with a KV cache dtype other than `auto`, it
    and `--dtype` (fp8 pages of either format are `uint8` in the host pool, and are filled
    from the compute dtype); `--json-model-override-args`; `--mamba-ssm-dtype`. Without
    them (a test, a tool) the name it was given is taken as the path."""
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
    except Exception:  # no server in this process
        return weights_identity(str(storage_config.model_name or ""), model_revision)
    cache = str(_resolved(args, "kv_cache_dtype") or "auto")
    checkpoint = weights_identity(str(args.model_path or storage_config.model_name or ""), model_revision,
                                  _resolved(args, "revision"))
    return checkpoint + numerics(
        quant=_resolved(args, "quantization"), modelopt=_resolved(args, "modelopt_quant"),
        compute=None if cache == "auto" else str(_resolved(args, "dtype") or "auto"),
        kv=None if cache == "auto" else cache,
        overrides=overrides_digest(_resolved(args, "json_model_override_args")),
        mamba=_resolved(args, "mamba_ssm_dtype"))


def _resolved(args: Any, name: str) -> Any:
    """SGLang's own decision for a server argument where it made one (it turns an `auto` KV
    cache into fp8 for some models), else the argument as given; None where it has none."""
    try:
        from sglang.srt.arg_groups.overrides import resolution_result

        return resolution_result(args, name)
    except Exception:  # an SGLang without resolutions, or no such argument
        return getattr(args, name, None)


def store_config(extra: dict[str, Any] | None) -> StoreConfig:
    """The kvstore config named by `config` in SGLang's extra config (a file or a mapping)."""
    source = (extra or {}).get("config")
    if not source:
        raise ConfigError("config", None, "required in --hicache-storage-backend-extra-config: a "
                                          "kvstore YAML/JSON file or the config as a mapping")
    return load_config(source)



def host_tensors(keys: list[str], tensors: list[Any]) -> list[torch.Tensor] | None:
    """The older calls' pages, each contiguous (a non-contiguous one as a copy the caller
    copies back); None, logged, unless there is one CPU tensor per key."""
    if len(tensors) != len(keys) or not all(isinstance(t, torch.Tensor) and t.device.type == "cpu"
                                            for t in tensors):
        log.warning("kvstore: %d pages given for %d keys, not all CPU tensors; counted as misses",
                    len(tensors), len(keys))
        return None
    return [t if t.is_contiguous() else t.contiguous() for t in tensors]


class TransferMetrics:
    """SGLang's StorageMetrics (pages per batch, GB/s per batch), kept only where its
    config enables them, handed over and cleared by `take`."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._values: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [],
                                                "prefetch_bandwidth": [], "backup_bandwidth": []}

    def add(self, kind: str, pages: int, chunk_bytes: int, started: float) -> None:
        """A batch of `kind` (prefetch or backup) that moved `pages` since `started`."""
        if self.enabled and pages:
            self._values[f"{kind}_pgs"].append(pages)
            seconds = max(time.perf_counter() - started, 1e-9)
            self._values[f"{kind}_bandwidth"].append(pages * chunk_bytes / seconds / 1e9)

    def take(self) -> Any:
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics(**{name: list(values) for name, values in self._values.items()})
        for values in self._values.values():
            values.clear()
        return metrics

class KVStoreHiCache(HiCacheStorage):
    """HiCacheStorage over the kvstore service. A miss, a page that failed verification
    and a service past its deadline all answer False / None, never raise."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.store = store_config(storage_config.extra_config)
        extra = storage_config.extra_config or {}
        self.model = str(extra.get("model_id") or storage_config.model_name or "")
        self.suffix = shard_suffix(storage_config, storage_config.is_mla_model)
        self.writer = storage_config.is_storage_writer
        self.weights = Weights(served_weights(storage_config, extra.get("model_revision")))
        self.pools = HybridPools(storage_config, self._pools_prefix())
        self.reads: PageIO | None = None
        self.writes: PageIO | None = None
        self._identity = ""
        self._opened: tuple[int, str] | None = None  # the chunk size and layout opened with
        self._opening = threading.Lock()  # one (re)connect at a time: SGLang calls from several threads
        self._reopen_at: float | None = None  # when to connect again (None: connected, or closed)
        self._metrics = TransferMetrics(bool(storage_config.enable_storage_metrics))

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The host pool pages move in and out of: its page geometry fixes the chunk size.
        SGLang empties it at every cache flush, and every weight update flushes (the four
        `update_weights_*`), but never tells its storage backend: so this backend clears
        itself then (`clear`: a new generation), or it would serve KV of the old weights."""
        super().register_mem_pool_host(mem_pool_host)
        first_page = torch.arange(mem_pool_host.page_size, dtype=torch.int64)
        chunk_bytes = sum(size for _, size in self._pool_pages(first_page, 1)[0])
        self._open(chunk_bytes, f"{mem_pool_host.layout}|{mem_pool_host.dtype}")
        emptied = mem_pool_host.clear

        def flushed() -> None:
            emptied()
            self.clear()

        mem_pool_host.clear = flushed

    def _pools_prefix(self) -> str:
        kind = "mla" if self.storage_config.is_mla_model else "mha"
        return f"sglang|{self.model}|{self._weights_id()}|{kind}|v2"

    def _weights_id(self) -> str:
        return self.weights.fingerprint + (f"#{self.weights.generation}" if self.weights.generation else "")

    def _open(self, chunk_bytes: int, layout: str) -> None:
        """(Re)connect for pages of `chunk_bytes`; the connection's namespace (what its
        records' headers name) is this backend's identity, announced described. Raises
        what connecting raised (at start-up, a bad config is an error)."""
        self._drop()
        mla = "mla" if self.storage_config.is_mla_model else "mha"
        self._identity = f"sglang|{self.model}|{self._weights_id()}|{mla}|{layout}|{chunk_bytes}"
        self._opened = (chunk_bytes, layout)
        description: dict[str, str | int] = {
            "engine": "sglang", "model": self.model, "weights": self.weights.fingerprint,
            "generation": self.weights.generation, "kv_layout": f"{mla}|{layout}", "chunk_bytes": chunk_bytes}
        self.reads, self.writes = service_pages(self.store, "config", chunk_bytes,
                                                key_digest(self._identity.encode()), description)
        self._reopen_at = None

    def _io(self, load: bool) -> PageIO | None:
        """The reads' or writes' connection pair, made again where it could not be (after
        clear(), on this caller's thread, at most every REOPEN_S): a failed reconnect is
        misses for a while, never the backend's end."""
        if self._reopen_at is not None and time.monotonic() >= self._reopen_at and self._opened is not None:
            with self._opening:
                if self._reopen_at is not None and time.monotonic() >= self._reopen_at:
                    try:
                        self._open(*self._opened)
                    except Exception as exc:
                        self._reopen_at = time.monotonic() + REOPEN_S
                        log.warning("kvstore: connecting for %s's pages failed (%s); misses until "
                                    "it connects (tried again in %.0f s)", self.model, exc, REOPEN_S)
        return self.reads if load else self.writes

    def key(self, key: str) -> bytes:
        return key_digest(f"{self._identity}|{self.suffix}|{key}".encode())

    def _pool_pages(self, host_indices: torch.Tensor, count: int) -> list[Segments]:
        """Each page's segments in the host pool, in the flat page's order (all K, then all
        V: the pool lists a layer-first page's pieces as K0, V0, K1, V1, ...)."""
        pointers, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        pieces = list(zip(flat_ints(pointers), flat_ints(sizes), strict=True))
        if count == 0 or len(pieces) % count:
            raise ValueError(f"{len(pieces)} buffer pieces for {count} pages")
        per = len(pieces) // count
        pages: list[Segments] = [pieces[i * per : (i + 1) * per] for i in range(count)]
        if self.storage_config.is_mla_model:
            return pages
        return [[*page[0::2], *page[1::2]] for page in pages]

    def _v1(self, keys: list[str], host_indices: torch.Tensor, load: bool,
            extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Pages by address; a save is one chain under the last of SGLang's `prefix_keys`."""
        io = self._io(load)
        if io is None or not keys:
            return [False] * len(keys)
        if not load and not self.writer:
            return [True] * len(keys)  # SGLang's rule: one writer per replicated MLA shard
        started = time.perf_counter()
        try:
            pages = self._pool_pages(host_indices, len(keys))
            ours = [self.key(k) for k in keys]
            done = io.load(ours, pages) if load else io.save(ours, pages, self._parent(extra_info))
        except Exception:  # a None or an exception would stop SGLang's prefetch/backup thread
            log.exception("kvstore %s of %d pages failed; counted as misses",
                          "load" if load else "save", len(keys))
            return [False] * len(keys)
        self._metrics.add("prefetch" if load else "backup", sum(done), io.chunk_bytes, started)
        return done

    def _parent(self, extra_info: HiCacheStorageExtraInfo | None) -> bytes | None:
        """The key of the page before a save's pages (None where SGLang sent none)."""
        prefix = extra_info.prefix_keys if extra_info is not None else None
        return self.key(prefix[-1]) if prefix else None

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._v1(keys, host_indices, load=True)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._v1(keys, host_indices, load=False, extra_info=extra_info)

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """The length of the leading run of keys the store holds."""
        reads = self._io(load=True)
        if reads is None:
            return 0
        try:
            return reads.present([self.key(k) for k in keys])
        except Exception:
            log.exception("kvstore lookup failed; counted as a miss")
            return 0

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A hybrid model's host pool (SGLang registers the KV pool here too, which the v1
        path already serves): its pages are keyed and cut into chunks apart."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if str(host_pool_name) != PoolName.KV.value:
            self.pools.register(str(host_pool_name), host_pool)

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The usable prefix: the KV run, shrunk by each extra pool's hit policy."""
        run = self.batch_exists(keys)  # first: it reconnects where due
        return self.pools.exists(self.reads, keys, run, pool_transfers or [])

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._v2(transfers, load=True)

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._v2(transfers, load=False, extra_info=extra_info)

    def _v2(self, transfers: list[PoolTransfer], load: bool,
            extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        io = self._io(load)
        return {t.name: self._v1(list(t.keys or []), t.host_indices, load, extra_info)
                if str(t.name) == PoolName.KV.value
                else self.pools.move(io, t, load) for t in transfers}

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def _tensor_io(self, keys: list[str], tensors: list[Any], load: bool) -> list[bool]:
        """The older calls: whole flat pages as host tensors (a page that is not a CPU
        tensor of the chunk's size is a miss; a non-contiguous one is filled through a
        contiguous copy)."""
        if not keys or (flat := host_tensors(keys, tensors)) is None:
            return [False] * len(keys)
        pages: list[Segments] = [[(t.data_ptr(), t.numel() * t.element_size())] for t in flat]
        if self._opened is None:  # no host pool registered: the first page's size is the chunk's
            with self._opening:
                if self._opened is None:
                    self._opened, self._reopen_at = (pages[0][0][1], "flat"), 0.0
        io = self._io(load)
        if io is None or any(page[0][1] != io.chunk_bytes for page in pages):
            return [False] * len(keys)
        if not load and not self.writer:
            return [True] * len(keys)
        try:
            done = (io.load if load else io.save)([self.key(k) for k in keys], pages)
        except Exception:
            log.exception("kvstore page transfer failed; counted as misses")
            return [False] * len(keys)
        for target, page, ok in zip(tensors, flat, done, strict=True):
            if load and ok and page is not target:
                target.copy_(page)
        return done

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        found = self.batch_get([key], [target_location])
        return found[0] if isinstance(found, list) else None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        targets = list(target_locations or [])
        if len(targets) != len(keys) or any(t is None for t in targets):
            return [None] * len(keys)  # kvstore fills the caller's memory; it allocates none
        done = self._tensor_io(keys, targets, load=True)
        return [t if ok else None for t, ok in zip(targets, done, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if values is None:
            return False
        return all(self._tensor_io(keys, list(values), load=False))

    def get_stats(self) -> Any:
        return self._metrics.take()

    def clear(self) -> None:
        """SGLang clears its storage tier (asked to), or flushed its caches (after a weight
        update: `register_mem_pool_host`): a new generation of this backend's keys, so
        nothing it stored before is found by it again. Nothing is deleted: the tiers are
        shared with other engines (`kvstore purge`)."""
        self.weights = Weights(self.weights.fingerprint, secrets.token_hex(8))
        self.pools.rekey(self._pools_prefix())
        with self._opening:  # reconnected in the new generation's namespace by the next call
            self._drop()
            self._reopen_at = 0.0 if self._opened is not None else None
        log.info("kvstore: clear() started generation %s of %s's pages (nothing deleted)",
                 self.weights.generation, self.model)

    def close(self) -> None:
        with self._opening:
            self._reopen_at = None  # for good
            self._drop()

    def _drop(self) -> None:
        """Close the connection pair (the old generation's, or for good)."""
        for io in (self.reads, self.writes):
            if io is not None:
                io.close()
        self.reads = self.writes = None

