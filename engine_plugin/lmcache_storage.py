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
behind the weights' identity and generation (connectors/key_scope.py), hashed into
kvstore's 16-byte key: `clear` starts a new generation, `remove` hides a chunk from this
engine; nothing is deleted. Whatever misses, fails verification or runs past the
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
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from connectors.key_scope import KeyScope
from connectors.page_io import Segments
from connectors.weights import weights_identity
from kvstore.format.errors import ConfigError
from kvstore.io.aligned import AlignedBuffer

log = logging.getLogger("kvstore.lmcache")
HEADER = 4096


def chunk_header(obj: MemoryObj) -> np.ndarray:
    """The 4 KiB header stored before a chunk's payload (this plugin's and the MP server's
    L2 adapter's, engine_plugin/lmcache_l2.py): what a load needs to know the chunk by."""
    text = json.dumps({"shape": list(obj.get_shape()), "dtype": str(obj.get_dtype()).removeprefix("torch."),
                       "fmt": obj.get_memory_format().name, "size": obj.get_size()}).encode()
    header = np.zeros(HEADER, np.uint8)
    header[: len(text)] = np.frombuffer(text, np.uint8)
    return header


def read_header(row: np.ndarray) -> dict[str, Any]:
    """A chunk's header (chunk_header) as stored: shape, dtype, fmt and payload size."""
    header: dict[str, Any] = json.loads(row[:HEADER].tobytes().rstrip(b"\0"))
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
        self.chunk_bytes = HEADER + int(local_cpu_backend.get_full_chunk_size_bytes())
        self._padding = np.zeros(self.chunk_bytes, np.uint8)
        extra = getattr(config, "extra_config", None) or {}
        if not (source := extra.get("kvstore.config")):
            raise ConfigError("extra_config.kvstore.config", None, "required: a kvstore file or mapping")
        self._source, self._model = source, str(getattr(metadata, "model_name", "") or "")
        self.scope = KeyScope(weights_identity(self._model, extra.get("kvstore.model_revision")))
        self._connect()
        self._pinned: set[bytes] = set()
        self._getter = ThreadPoolExecutor(1, "kvstore-lmcache-get")
        self._scratch_memory: AlignedBuffer | None = None
        self._scratch = np.empty((0, 0), np.uint8)
        self._scratch_lock = threading.Lock()
        self._full: tuple[torch.Size, torch.dtype, MemoryFormat] | None = None

    def _connect(self) -> None:
        self.reads, self.writes = self.scope.pages(self._source, "extra_config.kvstore.config",
                                                   self.chunk_bytes, "lmcache", self._model)

    def key(self, key: Any) -> bytes:
        return self.scope.key(key.to_string())

    def contains(self, key: Any, pin: bool = False) -> bool:
        return self.batched_contains([key], pin) == 1

    def batched_contains(self, keys: list[Any], pin: bool = False) -> int:
        """The leading run of keys stored (one request)."""
        try:
            found = self.reads.present(self.scope.leading([self.key(k) for k in keys]))
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
            self._learn(obj)
            headers.append(chunk_header(obj))
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
        """Each chunk is loaded straight into an object of a full chunk's shape (learnt from
        the first full chunk put or loaded: one copy), its header into a scratch row. A
        chunk of another shape (a prompt's shorter last chunk) is then copied into an
        object of its own; before any full shape is known, whole chunks land in scratch."""
        full = self._full
        with self._scratch_lock:
            scratch = self._scratch_rows(len(keys), HEADER if full else self.chunk_bytes)
            landed = [self.local_cpu_backend.allocate(*full) if full else None for _ in keys]
            pages: list[Segments | None] = [
                [(row.ctypes.data, self.chunk_bytes)] if full is None
                else None if obj is None  # LMCache's CPU backend is full: a miss
                else [(row.ctypes.data, HEADER), (obj.data_ptr, self.chunk_bytes - HEADER)]
                for row, obj in zip(scratch, landed, strict=False)]
            shown = self.scope.visible([self.key(k) for k in keys])
            wanted = [i for i, page in enumerate(pages) if page is not None and shown[i]]
            try:
                loaded = self.reads.load([self.key(keys[i]) for i in wanted],
                                         [page for page in pages if page is not None])
            except Exception:
                log.exception("kvstore load failed; counted as misses")
                loaded = [False] * len(wanted)
            found: list[MemoryObj | None] = [None] * len(keys)
            for i, ok in zip(wanted, loaded, strict=True):
                found[i] = self._object(scratch[i], landed[i]) if ok else None
            for obj, kept in zip(landed, found, strict=True):
                if obj is not None and obj is not kept:
                    obj.ref_count_down()
            if full is None and any(found):
                self._learn(next(obj for obj in found if obj is not None))
            return found

    def _scratch_rows(self, rows: int, width: int) -> np.ndarray:
        """Reusable scratch rows, in huge pages where the kernel gives them: fresh memory
        costs a page fault per 4 KiB page on first touch."""
        if self._scratch.shape[0] < rows or self._scratch.shape[1] < width:
            self._scratch_memory = AlignedBuffer(rows * width)
            self._scratch = np.frombuffer(self._scratch_memory.view, np.uint8).reshape(rows, width)
            self._scratch.fill(0)  # the faults now, not in the middle of a load
        return self._scratch

    def _learn(self, obj: MemoryObj) -> None:
        """Remember a full chunk's (shape, dtype, format): loads allocate it up front."""
        if self._full is None and obj.get_size() == self.chunk_bytes - HEADER and len(obj.get_shapes()) == 1:
            self._full = (obj.get_shape(), obj.get_dtype(), obj.get_memory_format())

    def _object(self, chunk: np.ndarray, landed: MemoryObj | None) -> MemoryObj | None:
        """The loaded chunk as an object of its stored shape: `landed` where it is of that
        shape (the payload is already in it), else a new one the payload is copied into."""
        header = read_header(chunk)
        stored = (torch.Size(header["shape"]), getattr(torch, header["dtype"]), MemoryFormat[header["fmt"]])
        if landed is not None and stored == (landed.get_shape(), landed.get_dtype(),
                                             landed.get_memory_format()):
            return landed
        obj = self.local_cpu_backend.allocate(*stored)
        if obj is None:
            log.warning("kvstore: LMCache's CPU backend is full; a stored chunk counts as a miss")
            return None
        source = landed.data_ptr if landed is not None else chunk.ctypes.data + HEADER
        ctypes.memmove(obj.data_ptr, source, header["size"])
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
        """Hidden from this backend, not deleted (module docstring)."""
        self.scope.hide([self.key(key)])
        return True

    def clear(self) -> int:
        """A new generation (after a weight update; module docstring); 0 tokens removed here."""
        old = (self.reads, self.writes)
        weights = self.scope.new_generation()
        self._connect()
        for io in old:
            io.close()
        log.info("kvstore: LMCache clear() started generation %s (nothing deleted)", weights.generation)
        return 0

    def touch_cache(self) -> None:
        pass

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    def close(self) -> None:
        self._getter.shutdown(wait=True)
        self.reads.close()
        self.writes.close()
