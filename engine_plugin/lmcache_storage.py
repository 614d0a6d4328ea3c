"""An LMCache storage plugin backed by the per-host kvstore service.

LMCache loads it from its config only (docs/lmcache.md):

    storage_plugins: ["kvstore"]
    extra_config:
      storage_plugin.kvstore.module_path: engine_plugin.lmcache_storage
      storage_plugin.kvstore.class_name: KVStoreBackend
      kvstore.config: /etc/kvstore.yaml

One LMCache chunk is one kvstore chunk: a 4 KiB header (the chunk's shape, dtype and
memory format, which LMCache needs to allocate the object it returns, and the size of a
prompt's shorter last chunk) followed by the payload, padded to LMCache's full chunk
size. Keys are LMCache's own key string (model, world size, worker, chunk hash, dtype)
hashed into kvstore's 16-byte key. Whatever misses, fails verification or runs past the
service deadline is None / False, never an exception into LMCache's threads.

This module imports LMCache (the class must subclass its StoragePluginInterface);
nothing in kvstore/ or connectors/ imports it.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import xxhash
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from connectors.page_io import PageIO, Segments
from kvstore.config.store import load_config
from kvstore.format.errors import ConfigError
from kvstore.io.aligned import AlignedBuffer
from kvstore.service.client import StoreClient

log = logging.getLogger("kvstore.lmcache")
HEADER = 4096


def _header(obj: MemoryObj) -> np.ndarray:
    text = json.dumps({"shape": list(obj.get_shape()), "dtype": str(obj.get_dtype()).removeprefix("torch."),
                       "fmt": obj.get_memory_format().name, "size": obj.get_size()}).encode()
    header = np.zeros(HEADER, np.uint8)
    header[: len(text)] = np.frombuffer(text, np.uint8)
    return header


class KVStoreBackend(StoragePluginInterface):
    """StoragePluginInterface over the kvstore service (loads and saves through
    connectors/page_io.py; puts are done when `batched_submit_put_task` returns)."""

    def __init__(self, dst_device: str = "cpu", config: Any = None, metadata: Any = None,
                 local_cpu_backend: Any = None, loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        if local_cpu_backend is None:
            raise ConfigError("local_cpu", None, "the kvstore plugin allocates LMCache's chunks in its "
                                                 "CPU backend: set max_local_cpu_size > 0")
        source = (getattr(config, "extra_config", None) or {}).get("kvstore.config")
        if not source:
            raise ConfigError("extra_config.kvstore.config", None, "required: a kvstore YAML/JSON file "
                                                                   "or the config as a mapping")
        store = load_config(source)
        self.chunk_bytes = HEADER + int(local_cpu_backend.get_full_chunk_size_bytes())
        self._padding = np.zeros(self.chunk_bytes, np.uint8)
        namespace = xxhash.xxh3_128_digest(f"lmcache|{self.chunk_bytes}".encode())

        def make_client() -> StoreClient:
            return StoreClient(store, self.chunk_bytes, namespace=namespace)

        self.reads, self.writes = PageIO(make_client, self.chunk_bytes), PageIO(make_client, self.chunk_bytes)
        self._pinned: set[bytes] = set()
        self._getter = ThreadPoolExecutor(1, "kvstore-lmcache-get")
        self._scratch_memory: AlignedBuffer | None = None
        self._scratch = np.empty((0, self.chunk_bytes), np.uint8)
        self._scratch_lock = threading.Lock()

    @staticmethod
    def key(key: Any) -> bytes:
        return xxhash.xxh3_128_digest(key.to_string().encode())

    def contains(self, key: Any, pin: bool = False) -> bool:
        return self.batched_contains([key], pin) == 1

    def batched_contains(self, keys: list[Any], pin: bool = False) -> int:
        """The leading run of keys stored (one request)."""
        try:
            found = self.reads.present([self.key(k) for k in keys])
        except Exception:
            log.exception("kvstore lookup failed; counted as a miss")
            return 0
        if pin:
            self._pinned.update(self.key(k) for k in keys[:found])
        return found

    async def batched_async_contains(self, lookup_id: str, keys: list[Any], pin: bool = False) -> int:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._getter, self.batched_contains, keys, pin)

    def exists_in_put_tasks(self, key: Any) -> bool:
        return False  # a put is stored (or dropped) when batched_submit_put_task returns

    def batched_submit_put_task(self, keys: Sequence[Any], objs: list[MemoryObj], transfer_spec: Any = None,
                                on_complete_callback: Callable[[Any], None] | None = None) -> None:
        headers, pages, chosen = [], [], []
        for key, obj in zip(keys, objs, strict=True):
            size = obj.get_size()
            if len(obj.get_shapes()) != 1 or size > self.chunk_bytes - HEADER:
                log.warning("kvstore: chunk %s (%d bytes, %d tensors) not stored: one tensor of at most "
                            "%d bytes fits", key, size, len(obj.get_shapes()), self.chunk_bytes - HEADER)
                continue
            headers.append(_header(obj))
            pad = self.chunk_bytes - HEADER - size
            page: Segments = [(headers[-1].ctypes.data, HEADER), (obj.data_ptr, size)]
            pages.append([*page, (self._padding.ctypes.data, pad)] if pad else page)
            chosen.append(key)
        try:
            stored = self.writes.save([self.key(k) for k in chosen], pages)
        except Exception:
            log.exception("kvstore save failed; the chunks are not stored")
            return None
        for key, ok in zip(chosen, stored, strict=True):
            if ok and on_complete_callback is not None:
                try:
                    on_complete_callback(key)
                except Exception:
                    log.exception("LMCache's put callback failed for %s", key)
        return None

    def batched_get_blocking(self, keys: list[Any]) -> list[MemoryObj | None]:
        """Each chunk lands in a scratch page, then its payload is copied into an object of
        the stored shape from LMCache's CPU backend (the shape is known only once read).
        The scratch is kept for the next call, in huge pages where the kernel gives them:
        fresh memory costs a page fault per 4 KiB page on first touch."""
        with self._scratch_lock:
            if len(self._scratch) < len(keys):
                self._scratch_memory = AlignedBuffer(len(keys) * self.chunk_bytes)
                self._scratch = np.frombuffer(self._scratch_memory.view, np.uint8).reshape(len(keys), -1)
                self._scratch.fill(0)  # the faults now, not in the middle of a load
            scratch = self._scratch
            pages: list[Segments] = [[(scratch[i].ctypes.data, self.chunk_bytes)] for i in range(len(keys))]
            try:
                loaded = self.reads.load([self.key(k) for k in keys], pages)
            except Exception:
                log.exception("kvstore load failed; counted as misses")
                return [None] * len(keys)
            return [self._object(scratch[i]) if ok else None for i, ok in enumerate(loaded)]

    def _object(self, chunk: np.ndarray) -> MemoryObj | None:
        header = json.loads(chunk[:HEADER].tobytes().rstrip(b"\0"))
        obj = self.local_cpu_backend.allocate(torch.Size(header["shape"]), getattr(torch, header["dtype"]),
                                              MemoryFormat[header["fmt"]])
        if obj is None:
            log.warning("kvstore: LMCache's CPU backend is full; a stored chunk counts as a miss")
            return None
        ctypes.memmove(obj.data_ptr, chunk.ctypes.data + HEADER, header["size"])
        return obj

    def get_blocking(self, key: Any) -> MemoryObj | None:
        return self.batched_get_blocking([key])[0]

    def get_non_blocking(self, key: Any, location: str | None = None) -> Future[MemoryObj | None] | None:
        return self._getter.submit(self.get_blocking, key)

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any],
                                       transfer_spec: Any = None) -> list[MemoryObj]:
        """The leading run of chunks loaded (LMCache's prefetch takes a prefix)."""
        loop = asyncio.get_running_loop()
        found = await loop.run_in_executor(self._getter, self.batched_get_blocking, keys)
        run = next((i for i, obj in enumerate(found) if obj is None), len(found))
        for obj in found[run:]:
            if obj is not None:
                obj.ref_count_down()
        return [obj for obj in found[:run] if obj is not None]

    def pin(self, key: Any) -> bool:
        """Remembered only: kvstore evicts by its own policy and a chunk evicted after a
        pin is a miss at get (LMCache then recomputes), never wrong data."""
        if not self.contains(key):
            return False
        self._pinned.add(self.key(key))
        return True

    def unpin(self, key: Any) -> bool:
        self._pinned.discard(self.key(key))
        return True

    def remove(self, key: Any, force: bool = True) -> bool:
        """kvstore's service takes no deletes from engines (the store is shared and
        evicts by itself): nothing is removed."""
        return False

    def touch_cache(self) -> None:
        pass

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    def close(self) -> None:
        self._getter.shutdown(wait=True)
        self.reads.close()
        self.writes.close()
