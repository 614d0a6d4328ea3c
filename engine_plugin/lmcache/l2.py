"""kvstore as the L2 storage adapter of LMCache's multi-process (MP) server.

LMCache's MP server (`python -m lmcache.v1.multiprocess.server`) keeps KV chunks in its
own L1 memory and hands them to its L2 adapters; this one stores them in the per-host
kvstore service, loaded by LMCache's own `plugin` adapter type (docs/lmcache.md):

    --l2-adapter '{"type": "plugin", "module_path": "engine_plugin.lmcache.l2",
                   "class_name": "KVStoreL2Adapter",
                   "adapter_params": {"config": "/etc/kvstore.yaml", "chunk_bytes": 33554432}}'

LMCache finds `KVStoreL2AdapterConfig` by its name and builds it from `adapter_params`.
`chunk_bytes` is the size of the server's chunk objects (chunk_size x layers x 2 x KV
heads x head size x dtype bytes for a plain attention model): the kvstore service stores
one chunk size, and a fresh server must know it before it has seen an object. A chunk is
stored as in the storage plugin (engine_plugin/lmcache/storage.py): a 4 KiB header
(shape, dtype, payload size) and the payload, padded to `chunk_bytes`, under LMCache's
key (model, rank, object group, chunk hash, cache salt) behind the model's weights
(`model_revision`, else a fingerprint of the checkpoint the key's model names:
engine_plugin/lmcache/key_scope.py), hashed into kvstore's 16-byte key. A model whose weights cannot
be named is neither stored nor loaded (logged once). `delete` hides chunks from this
adapter; nothing is deleted.

Every task runs on a thread of its own and ends with its event fd signalled; whatever
misses, fails the service's verification, runs past its deadline or raises is a miss
(a 0 bit) or a failed store, never an exception into LMCache's controller threads.

Locks: `submit_lookup_and_lock_task` locks nothing and `submit_unlock` has nothing to
release. kvstore evicts by its own policy and its pins are per connection and per
request; a chunk evicted between LMCache's lookup and its load is a 0 bit in the load's
bitmap (LMCache then recomputes it), never wrong data: the load reads the chunk anew and
the service verifies it.

This module imports LMCache (the class must subclass its L2AdapterInterface); nothing in
kvstore/ or connectors/ imports it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L1MemoryDesc, L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import create_event_notifier

from connectors.page_io import Segments, service_pages
from connectors.weights import weights_identity
from connectors.worker_threads import pool
from engine_plugin.lmcache.key_scope import KeyScope
from engine_plugin.lmcache.storage import HEADER, BadHeader, chunk_header, described, read_header
from kvstore.format.errors import ConfigError
from kvstore.format.keys import key_digest

log = logging.getLogger("kvstore.lmcache")
Result = TypeVar("Result")



class KVStoreL2AdapterConfig(L2AdapterConfigBase):
    """`adapter_params`: `config` (a kvstore YAML/JSON file or the config as a mapping),
    `chunk_bytes` (the MP server's chunk object size; larger objects are not stored) and
    `model_revision` (optional: the weights' identity instead of a checkpoint fingerprint)."""

    def __init__(self, config: Any, chunk_bytes: int, model_revision: str | None = None) -> None:
        self.config = config
        self.chunk_bytes = chunk_bytes
        self.model_revision = model_revision

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVStoreL2AdapterConfig:
        if not d.get("config"):
            raise ConfigError("adapter_params.config", None,
                              "required: a kvstore YAML/JSON file or the config as a mapping")
        size = d.get("chunk_bytes")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ConfigError("adapter_params.chunk_bytes", size,
                              "required: the MP server's chunk object size in bytes (a positive int)")
        revision = d.get("model_revision")
        if revision is not None and not isinstance(revision, str):
            raise ConfigError("adapter_params.model_revision", revision, "must be a string")
        return cls(d["config"], size, revision)

    @classmethod
    def help(cls) -> str:
        return ("kvstore L2 adapter (adapter_params):\n"
                "- config (str or dict): the kvstore config file, or the config itself (required)\n"
                "- chunk_bytes (int): the size of the MP server's chunk objects (required)\n"
                "- model_revision (str): the weights' identity in keys (default: a fingerprint of "
                "the model's checkpoint files)")


def object_key(key: ObjectKey, scope: KeyScope) -> bytes:
    """LMCache's whole key (every field that names a chunk) behind its model's weights,
    hashed into kvstore's key."""
    return scope.key(f"lmcache-mp|{key.model_name}@{key.kv_rank:#x}@{key.object_group_id:x}@"
                     f"{key.chunk_hash.hex()}@{key.cache_salt}")


class ModelScopes:
    """kvstore's key of each LMCache ObjectKey, behind its model's weights (one KeyScope a
    model name, made on first use; None where its weights cannot be named, whose chunks
    are neither stored nor loaded), and the keys LMCache deleted, hidden."""

    def __init__(self, revision: str | None) -> None:
        self._revision = revision
        self._scopes: dict[str, KeyScope | None] = {}
        self._lock = threading.Lock()

    def keys(self, keys: list[ObjectKey]) -> list[bytes | None]:
        """kvstore's key of each (None: its model's weights cannot be named)."""
        found: list[bytes | None] = []
        for key in keys:
            scope = self._scope(key.model_name)
            found.append(object_key(key, scope) if scope is not None else None)
        return found

    def visible(self, keys: list[ObjectKey]) -> list[bytes | None]:
        """`keys`, with the ones deleted as None."""
        ours = self.keys(keys)
        for i, (key, mine) in enumerate(zip(keys, ours, strict=True)):
            scope = self._scope(key.model_name)
            if mine is not None and scope is not None and not scope.visible([mine])[0]:
                ours[i] = None
        return ours

    def hide(self, keys: list[ObjectKey]) -> None:
        for key, ours in zip(keys, self.keys(keys), strict=True):
            scope = self._scope(key.model_name)
            if scope is not None and ours is not None:
                scope.hide([ours])

    def _scope(self, model: str) -> KeyScope | None:
        with self._lock:
            if model in self._scopes:
                return self._scopes[model]
        try:
            scope: KeyScope | None = KeyScope(weights_identity(model, self._revision))
        except ConfigError as exc:
            log.error("kvstore: chunks of %s are neither stored nor loaded: %s", model, exc)
            scope = None
        with self._lock:
            return self._scopes.setdefault(model, scope)

class KVStoreL2Adapter(L2AdapterInterface):
    """L2AdapterInterface over the kvstore service: stores on one thread and one service
    connection, lookups and loads on another, so a load never waits behind a store."""

    def __init__(self, config: KVStoreL2AdapterConfig, l1_memory_desc: L1MemoryDesc | None = None) -> None:
        super().__init__()
        self.payload_bytes = config.chunk_bytes
        self.chunk_bytes = HEADER + config.chunk_bytes
        self._padding = np.zeros(self.chunk_bytes, np.uint8)  # saves read it: stays zero
        self._sink = np.empty(self.chunk_bytes, np.uint8)  # loads drop a short chunk's padding here
        self.reads, self.writes = service_pages(
            config.config, "adapter_params.config", self.chunk_bytes,
            key_digest(f"lmcache-mp|{self.chunk_bytes}".encode()))
        self._notifiers = {name: create_event_notifier() for name in ("store", "lookup", "load")}
        self._storer = pool("kvstore-l2-store")  # unbound, as every thread that waits on the service
        self._reader = pool("kvstore-l2-load")
        self._lock = threading.Lock()
        self._next_id: L2TaskId = 0
        self._done: dict[str, dict[L2TaskId, Any]] = {"store": {}, "lookup": {}, "load": {}}
        self.scopes = ModelScopes(config.model_revision)

    def delete(self, keys: list[ObjectKey]) -> None:
        """LMCache deletes chunks: this adapter never finds them again (hidden; nothing is
        deleted from the shared store)."""
        self.scopes.hide(keys)

    # Event fds: one each, as LMCache's controllers require.

    def get_store_event_fd(self) -> int:
        return int(self._notifiers["store"].fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._notifiers["lookup"].fileno())

    def get_load_event_fd(self) -> int:
        return int(self._notifiers["load"].fileno())

    # Tasks

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit(self._storer, "store", lambda: self._store(keys, objects),
                            L2StoreResult(False, 0))

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._done["store"] = self._done["store"], {}
        return done

    def submit_lookup_and_lock_task(self, keys: list[ObjectKey],
                                    group_layout_descs: dict[int, MemoryLayoutDesc]) -> L2TaskId:
        """The leading run of keys the service holds (one request); locks nothing (module
        docstring)."""
        return self._submit(self._reader, "lookup", lambda: self._lookup(keys), Bitmap(len(keys)))

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            result: Bitmap | None = self._done["lookup"].pop(task_id, None)
        return result

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Nothing was locked (module docstring)."""

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit(self._reader, "load", lambda: self._load(keys, objects), Bitmap(len(keys)))

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            result: Bitmap | None = self._done["load"].pop(task_id, None)
        return result

    def _submit(self, workers: ThreadPoolExecutor, kind: str, work: Callable[[], Result],
                failed: Result) -> L2TaskId:
        """Run `work` on `workers`; its result (or `failed`, if it raised) is kept under the
        task id, then the kind's event fd is signalled."""
        with self._lock:
            task_id = self._next_id
            self._next_id += 1

        def run() -> None:
            try:
                result = work()
            except Exception:
                log.exception("kvstore L2 %s task %d failed; counted as a miss", kind, task_id)
                result = failed
            with self._lock:
                self._done[kind][task_id] = result
            self._notifiers[kind].notify()

        workers.submit(run)
        return task_id

    def _store(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2StoreResult:
        headers, pages, chosen, sizes = [], [], [], []
        for key, obj in zip(keys, objects, strict=True):
            size = obj.get_size()
            if size > self.payload_bytes:
                log.warning("kvstore: an L2 object of %d bytes is not stored: chunk_bytes is %d",
                            size, self.payload_bytes)
                continue
            headers.append(chunk_header(obj))
            pages.append(self._page(headers[-1].ctypes.data, obj.data_ptr, size, self._padding))
            chosen.append(key)
            sizes.append(size)
        ours = self.scopes.keys(chosen)
        usable = [i for i, key in enumerate(ours) if key is not None]
        saved = self.writes.save([key for key in ours if key is not None], [pages[i] for i in usable])
        stored = [False] * len(chosen)
        for i, ok in zip(usable, saved, strict=True):
            stored[i] = ok
        kept = [(key, size) for key, size, ok in zip(chosen, sizes, stored, strict=True) if ok]
        if kept:
            self._notify_keys_stored([key for key, _ in kept], [size for _, size in kept])
        return L2StoreResult(len(kept) == len(keys), sum(size for _, size in kept))

    def _lookup(self, keys: list[ObjectKey]) -> Bitmap:
        ours = self.scopes.visible(keys)
        run = ours.index(None) if None in ours else len(ours)
        return Bitmap(len(keys), self.reads.present([key for key in ours[:run] if key is not None]))

    def _load(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> Bitmap:
        """Each chunk straight into LMCache's buffer, its header into a scratch row; a
        chunk whose header does not describe the buffer is a miss."""
        bitmap = Bitmap(len(keys))
        rows = np.empty((len(keys), HEADER), np.uint8)
        ours = self.scopes.visible(keys)
        wanted = [i for i, obj in enumerate(objects) if obj.get_size() <= self.payload_bytes and ours[i]]
        pages = [self._page(rows[i].ctypes.data, objects[i].data_ptr, objects[i].get_size(), self._sink)
                 for i in wanted]
        loaded = self.reads.load([key for i in wanted if (key := ours[i]) is not None], pages)
        for i, ok in zip(wanted, loaded, strict=True):
            if ok and self._fits(rows[i], objects[i]):
                bitmap.set(i)
        found = [keys[i] for i in range(len(keys)) if bitmap.test(i)]
        if found:
            self._notify_keys_accessed(found)
        return bitmap

    def _fits(self, row: np.ndarray, obj: MemoryObj) -> bool:
        """The stored header describes LMCache's buffer exactly (shape, dtype, format,
        size); else the chunk is a counted miss (`load.bad_header`). The payload is in the
        buffer already: a load writes no more than the buffer's size, whatever the header."""
        wanted = described(obj)
        try:
            header: Any = read_header(row)
        except BadHeader as exc:
            header = exc
        else:  # compared as JSON: 16384.0 or true is not the int the buffer has
            if json.dumps(header, sort_keys=True) == json.dumps(wanted, sort_keys=True):
                return True
        self.reads.count_misses("bad_header", 1, "a stored L2 chunk (%.200s) does not fit LMCache's "
                                "buffer (%s): a miss", header, wanted)
        return False

    def _page(self, header: int, payload: int, size: int, padding: np.ndarray) -> Segments:
        pad = self.payload_bytes - size
        page: Segments = [(header, HEADER), (payload, size)]
        return [*page, (padding.ctypes.data, pad)] if pad else page

    def report_status(self) -> dict[str, Any]:
        return {"is_healthy": self.reads.link.peek() is not None, "type": "KVStoreL2Adapter",
                "chunk_bytes": self.payload_bytes}

    def close(self) -> None:
        self._storer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        self.reads.close()
        self.writes.close()
        for notifier in self._notifiers.values():
            notifier.close()
