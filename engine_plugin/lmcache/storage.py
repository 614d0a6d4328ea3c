"""An LMCache storage plugin backed by the per-host kvstore service.

LMCache loads it from its config only (docs/lmcache.md):

    storage_plugins: ["kvstore"]
    extra_config:
      storage_plugin.kvstore.module_path: engine_plugin.lmcache.storage
      storage_plugin.kvstore.class_name: KVStoreBackend
      kvstore.config: /etc/kvstore.yaml

One LMCache chunk is one kvstore chunk: a 4 KiB header (the chunk's shape, dtype and
memory format, which LMCache needs to allocate the object it returns, and the size of a
prompt's shorter last chunk) followed by the payload, padded to LMCache's full chunk
size. Keys are LMCache's own key string (model, world size, worker, chunk hash, dtype)
behind the weights' identity and generation (engine_plugin/lmcache/key_scope.py), hashed into
kvstore's 16-byte key: `clear` starts a new generation, `remove` hides a chunk from this
engine; nothing is deleted. Whatever misses, fails verification or runs past the
service deadline is None / False, never an exception into LMCache's threads.

A stored header is input from outside: any client of the service may have stored the
chunk (an `allowed_uids` user, a damaged engine). So a load trusts nothing in it
(`parse_header`): its dtype comes from an allow-list, its format is one of LMCache's KV
formats, its size is its shape's elements times the dtype's size and at most the
record's payload; it must be the object LMCache allocated for it (the full chunk's, or a
shorter one of the full chunk's shape with fewer tokens), and no more than that object
holds is copied. Anything else is a counted miss (`load.bad_header`), with every object
allocated for it released. Objects are allocated without LMCache's wait-for-ever retry:
a pool with nothing left to evict makes the rest of the load misses at once
(`load.no_memory`).

This module imports LMCache (the class must subclass its StoragePluginInterface);
nothing in kvstore/ or connectors/ imports it.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from connectors.page_io import PageIO, Segments
from connectors.weights import weights_identity
from connectors.worker_threads import pool
from engine_plugin.lmcache.key_scope import KeyScope
from kvstore.format.errors import ConfigError
from kvstore.io.aligned import AlignedBuffer

log = logging.getLogger("kvstore.lmcache")
HEADER = 4096
WAVE_BYTES = 256 << 20  # a load's chunks go in waves of at most this much scratch memory
# What a stored header may name: LMCache's KV dtypes and formats (never BINARY_BUFFER,
# whose objects are heap buffers of any size, nor UNDEFINED, which LMCache refuses).
DTYPES = {name: getattr(torch, name) for name in
          ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8")}
KV_FORMATS = {fmt.name: fmt for fmt in (MemoryFormat.KV_2LTD, MemoryFormat.KV_T2D, MemoryFormat.KV_2TD,
                                        MemoryFormat.KV_MLA_FMT)}
MAX_DIMS = 8
MAX_DIM = 1 << 31


def described(obj: MemoryObj) -> dict[str, Any]:
    """What a chunk's header says of it: shape, dtype, format and payload size."""
    return {"shape": list(obj.get_shape()), "dtype": str(obj.get_dtype()).removeprefix("torch."),
            "fmt": obj.get_memory_format().name, "size": obj.get_size()}


def chunk_header(obj: MemoryObj) -> np.ndarray:
    """The 4 KiB header stored before a chunk's payload (this plugin's and the MP server's
    L2 adapter's, engine_plugin/lmcache/l2.py): what a load needs to know the chunk by."""
    text = json.dumps(described(obj)).encode()
    header = np.zeros(HEADER, np.uint8)
    header[: len(text)] = np.frombuffer(text, np.uint8)
    return header


class BadHeader(ValueError):
    """A stored chunk's header that no load may act on (planted, damaged or foreign)."""


@dataclass(frozen=True)
class StoredChunk:
    """A stored chunk's header, checked (parse_header): what it says LMCache allocated."""

    shape: torch.Size
    dtype: torch.dtype
    fmt: MemoryFormat
    size: int  # = numel x itemsize, at most the record's payload

    @classmethod
    def of(cls, obj: MemoryObj) -> StoredChunk:
        return cls(obj.get_shape(), obj.get_dtype(), obj.get_memory_format(), obj.get_size())

    def within(self, full: StoredChunk) -> bool:
        """A chunk of `full`'s kind: its dtype and format, its shape in every dimension but
        the format's token dimension, and at most as many tokens (a prompt's shorter last
        chunk). Fewer layers or heads are another engine's chunk (MLA saved by one rank of
        a pipeline split otherwise), whose layers would be read from what follows it."""
        if (self.dtype, self.fmt, len(self.shape)) != (full.dtype, full.fmt, len(full.shape)):
            return False
        tokens = self.fmt.token_dim()
        return all(mine == theirs if dim != tokens else mine <= theirs
                   for dim, (mine, theirs) in enumerate(zip(self.shape, full.shape, strict=True)))


def read_header(row: np.ndarray) -> dict[str, Any]:
    """A chunk's header (chunk_header) as stored, its fields unchecked: BadHeader unless
    it is a JSON mapping of exactly shape, dtype, fmt and size."""
    try:
        header = json.loads(row[:HEADER].tobytes().rstrip(b"\0").decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BadHeader(f"not a JSON header ({type(exc).__name__})") from None
    if not isinstance(header, dict) or set(header) != {"shape", "dtype", "fmt", "size"}:
        raise BadHeader("not a mapping of shape, dtype, fmt and size")
    return header


def parse_header(row: np.ndarray, payload_bytes: int) -> StoredChunk:
    """A chunk's header (read_header), checked against what may be allocated for it:
    BadHeader (saying why) unless its shape is 1 to MAX_DIMS positive ints, its dtype one
    of DTYPES, its format one of KV_FORMATS and its size the shape's bytes, within
    `payload_bytes`."""
    header = read_header(row)
    shape, size = header["shape"], header["size"]
    if (not isinstance(shape, list) or not 1 <= len(shape) <= MAX_DIMS
            or not all(type(d) is int and 0 < d <= MAX_DIM for d in shape)):
        raise BadHeader(f"shape {str(shape)[:80]} is not 1 to {MAX_DIMS} positive ints")
    dtype = DTYPES.get(header["dtype"]) if isinstance(header["dtype"], str) else None
    fmt = KV_FORMATS.get(header["fmt"]) if isinstance(header["fmt"], str) else None
    if dtype is None or fmt is None:
        raise BadHeader(f"dtype {str(header['dtype'])[:40]} or format {str(header['fmt'])[:40]} "
                        "is not one a KV chunk has")
    if type(size) is not int or size != math.prod(shape) * dtype.itemsize or size > payload_bytes:
        raise BadHeader(f"size {str(size)[:40]} is not its shape's bytes within a {payload_bytes}-byte "
                        "payload")
    return StoredChunk(torch.Size(shape), dtype, fmt, size)


def expected_full(config: Any, metadata: Any, payload_bytes: int) -> StoredChunk | None:
    """The full chunk LMCache's engine allocates (its cache engine's shapes and format for
    a chunk of `chunk_size` tokens), where its metadata says it: one KV group, not
    layerwise, and exactly `payload_bytes`. None: learnt from the first put."""
    try:
        if metadata is None or config is None or config.use_layerwise:
            return None
        shapes, dtypes = metadata.get_shapes(config.chunk_size), metadata.get_dtypes()
        fmt = MemoryFormat.KV_MLA_FMT if metadata.use_mla else MemoryFormat.KV_2LTD
        if len(shapes) != 1 or len(dtypes) != 1:
            return None
        shape, dtype = torch.Size(shapes[0]), dtypes[0]
        chunk = StoredChunk(shape, dtype, fmt, math.prod(shape) * dtype.itemsize)
    except Exception:
        log.exception("kvstore: LMCache's metadata gives no chunk shape; learnt from the first put")
        return None
    return chunk if chunk.size == payload_bytes else None


class PoolLoads:
    """Chunks loaded from the service into objects of LMCache's CPU backend, every stored
    header checked first (module docstring); callable from several threads (one load at
    a time uses the scratch rows)."""

    def __init__(self, reads: PageIO, pool: Any, chunk_bytes: int, full: StoredChunk | None) -> None:
        """`pool`: LMCache's CPU backend; `full`: its full chunk, where known already."""
        self.reads = reads
        self.pool = pool
        self.chunk_bytes = chunk_bytes
        self._full = full
        self._scratch_memory: AlignedBuffer | None = None
        self._scratch = np.empty((0, 0), np.uint8)
        self._scratch_lock = threading.Lock()

    def load(self, keys: list[bytes]) -> list[MemoryObj | None]:
        """The chunks of `keys` (kvstore keys), each an object of LMCache's CPU backend,
        None where it missed (module docstring: what makes a stored chunk a miss); in waves
        of at most WAVE_BYTES of scratch. Once an allocation finds the pool full, the rest
        miss."""
        found: list[MemoryObj | None] = []
        wave = max(1, WAVE_BYTES // self.chunk_bytes)
        refused = 0  # chunks not loaded for want of memory
        for start in range(0, len(keys), wave):
            part = keys[start : start + wave]
            if refused:
                found += [None] * len(part)
                refused += len(part)
                continue
            loaded, short = self._get_wave(part)
            found += loaded
            refused += short
        if refused:
            self.reads.count_misses("no_memory", refused, "LMCache's CPU pool is full (nothing it can "
                                    "evict): %d stored chunks count as misses", refused)
        return found

    def _get_wave(self, keys: list[bytes]) -> tuple[list[MemoryObj | None], int]:
        """Each chunk is loaded straight into an object of the full chunk's shape (known
        from LMCache's metadata or its first full chunk put: one copy), its header into a
        scratch row; a shorter chunk (a prompt's last) is then copied into an object of its
        own. Before any full shape is known, whole chunks land in scratch. Returns the
        objects and how many chunks found no memory; every object not returned is released."""
        full = self._full
        landed: list[MemoryObj | None] = [None] * len(keys)
        found: list[MemoryObj | None] = [None] * len(keys)
        refused = 0
        with self._scratch_lock:
            scratch = self._scratch_rows(len(keys), HEADER if full else self.chunk_bytes)
            try:
                wanted = list(range(len(keys)))
                if full is not None:
                    for i in wanted:
                        landed[i] = self._allocate(full)
                        if landed[i] is None:
                            refused, wanted = len(keys) - i, wanted[:i]
                            break
                pages: list[Segments] = [
                    [(scratch[i].ctypes.data, HEADER), (obj.data_ptr, self.chunk_bytes - HEADER)]
                    if (obj := landed[i]) is not None else [(scratch[i].ctypes.data, self.chunk_bytes)]
                    for i in wanted]
                try:
                    loaded = self.reads.load([keys[i] for i in wanted], pages)
                except Exception:
                    log.exception("kvstore load failed; counted as misses")
                    loaded = [False] * len(wanted)
                for i, ok in zip(wanted, loaded, strict=True):
                    if ok:
                        found[i], no_memory = self._object(scratch[i], landed[i], may_allocate=not refused)
                        refused += no_memory
            finally:  # whatever happened, no object but those returned stays allocated
                kept = {id(obj) for obj in found if obj is not None}
                for obj in landed:
                    if obj is not None and id(obj) not in kept:
                        obj.ref_count_down()
        return found, refused

    def _allocate(self, chunk: StoredChunk) -> MemoryObj | None:
        """An object of LMCache's CPU backend for `chunk`, evicting what LMCache may, never
        waiting for memory (LMCache's default retries for ever); None: the pool is full."""
        try:
            obj = self.pool.allocate(chunk.shape, chunk.dtype, chunk.fmt, busy_loop=False)
        except Exception:  # LMCache refused the request: as full, for this load
            log.exception("LMCache's CPU backend refused to allocate %s", chunk)
            return None
        if obj is not None and (obj.get_size() < chunk.size or obj.get_shape() != chunk.shape):
            obj.ref_count_down()  # not what was asked for: never copy into it
            return None
        return obj

    def _scratch_rows(self, rows: int, width: int) -> np.ndarray:
        """Reusable scratch rows, in huge pages where the kernel gives them: fresh memory
        costs a page fault per 4 KiB page on first touch."""
        if self._scratch.shape[0] < rows or self._scratch.shape[1] < width:
            self._scratch_memory = AlignedBuffer(rows * width)
            self._scratch = np.frombuffer(self._scratch_memory.view, np.uint8).reshape(rows, width)
            self._scratch.fill(0)  # the faults now, not in the middle of a load
        return self._scratch

    def learn(self, obj: MemoryObj) -> None:
        """A full chunk LMCache put (its own object, so trusted) fixes the full chunk's
        shape, dtype and format; a stored header never does."""
        if obj.get_size() == self.chunk_bytes - HEADER and len(obj.get_shapes()) == 1:
            self._full = StoredChunk.of(obj)

    def _object(self, chunk: np.ndarray, landed: MemoryObj | None,
                may_allocate: bool) -> tuple[MemoryObj | None, bool]:
        """The loaded chunk as an object of its stored shape, checked (parse_header, and a
        shape of the full chunk's kind): `landed` where it is that object, else a new one
        (if `may_allocate`) the payload is copied into; None for a chunk that does not fit.
        Never raises; the second value: it found no memory."""
        try:
            stored = parse_header(chunk, self.chunk_bytes - HEADER)
            if landed is not None and stored == StoredChunk.of(landed):
                return landed, False
            full = self._full
            if full is not None and not stored.within(full):
                raise BadHeader(f"{stored} is not a chunk of this engine's kind ({full})")
        except BadHeader as exc:
            self.reads.count_misses("bad_header", 1, "a stored LMCache chunk's header does not fit "
                                    "this engine (%s): a miss", exc)
            return None, False
        obj = self._allocate(stored) if may_allocate else None
        if obj is None:
            return None, True
        source = landed.data_ptr if landed is not None else chunk.ctypes.data + HEADER
        ctypes.memmove(obj.data_ptr, source, stored.size)  # stored.size <= both objects' and the payload's
        return obj, False


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
        self._expected = expected_full(config, metadata, self.chunk_bytes - HEADER)
        self._connect()
        self._pinned: set[bytes] = set()
        self._getter = pool("kvstore-lmcache-get")  # unbound, as every thread that waits on the service

    def _connect(self) -> None:
        """Connections in this generation's namespace, and loads through them."""
        self.reads, self.writes = self.scope.pages(self._source, "extra_config.kvstore.config",
                                                   self.chunk_bytes, "lmcache", self._model)
        self.loads = PoolLoads(self.reads, self.local_cpu_backend, self.chunk_bytes, self._expected)

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
            if (len(obj.get_shapes()) != 1 or size > self.chunk_bytes - HEADER
                    or obj.get_memory_format().name not in KV_FORMATS
                    or str(obj.get_dtype()).removeprefix("torch.") not in DTYPES):
                log.warning("kvstore: chunk %s (%d bytes, %d tensors, %s, %s) not stored: one KV tensor "
                            "of at most %d bytes fits", key, size, len(obj.get_shapes()), obj.get_dtype(),
                            obj.get_memory_format().name, self.chunk_bytes - HEADER)
                continue
            self.loads.learn(obj)
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
        """Each chunk an object of LMCache's CPU backend, None where it missed (PoolLoads)
        or this backend removed it."""
        wanted = [self.key(k) for k in keys]
        shown = self.scope.visible(wanted)
        loaded = iter(self.loads.load([key for key, ok in zip(wanted, shown, strict=True) if ok]))
        return [next(loaded) if ok else None for ok in shown]

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
        """A new generation (after a weight update; module docstring); 0 tokens removed here.
        Connections that cannot be made in it leave the old ones closed: their namespace is
        the old generation's (a purge of it would take the new chunks), so loads miss and
        saves drop until the next clear() connects."""
        old = (self.reads, self.writes)
        weights = self.scope.new_generation()
        try:
            self._connect()
        except Exception:
            log.exception("kvstore: LMCache clear() could not connect in generation %s; loads miss "
                          "and saves drop until the next clear()", weights.generation)
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
