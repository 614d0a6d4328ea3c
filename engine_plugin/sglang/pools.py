"""SGLang's v2 pool interface for hybrid models: the extra host pools' pages as kvstore chunks.

A hybrid model (Mamba state, sliding-window KV, a DSA indexer) keeps, next to its KV host
pool, further host pools that SGLang registers with `register_mem_host_pool_v2` and moves
with `batch_get_v2` / `batch_set_v2`, under the KV pages' own hashes. Each pool has its own
page geometry, and one kvstore service stores one chunk size (the KV pool's page), so a
pool page is cut into as many chunks as it needs, the last one padded, and each chunk is
keyed by the pool's identity (name, class, layout, dtype, page bytes, whether the bytes are
the pool's zero-copy segments or its flat page), the page hash and the part. A page
counts only when every part is there and verified. `batch_exists_v2` follows SGLang's own
per-pool hit policies exactly as its reference backend (HiCacheFile) does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from connectors.page_io import PageIO, Segments
from kvstore.format.keys import key_digest

log = logging.getLogger("kvstore.sglang")

PRESENCE_WAVE = 128  # keys per lookup while finding which pages of a pool are stored


def shard_suffix(config: HiCacheStorageConfig, replicated: bool) -> str:
    """What keys a page to its shard: the TP rank (not for what every rank holds alike,
    e.g. MLA KV), pipeline stage, attention context-parallel and decode context-parallel rank."""
    parts = [] if replicated else [f"tp{config.tp_rank}/{config.tp_size}"]
    if config.pp_size > 1:
        parts.append(f"pp{config.pp_rank}/{config.pp_size}")
    if config.attn_cp_size > 1:
        parts.append(f"cp{config.attn_cp_rank}/{config.attn_cp_size}")
    if config.dcp_size > 1:
        parts.append(f"dcp{config.dcp_rank}/{config.dcp_size}/page{config.logical_page_size}")
    return "|".join(parts)


def flat_ints(values: Any) -> list[int]:
    """A pool's pointer/size lists, flattened (a multi-buffer pool nests one list per page)."""
    out: list[int] = []
    for value in values:
        out.extend(flat_ints(value) if isinstance(value, list | tuple) else [int(value)])
    return out


@dataclass(frozen=True)
class HostPool:
    """One extra host pool: its page geometry and how its pages' bytes are reached."""

    pool: Any
    identity: str  # what its pages' bytes depend on, and the shard
    page_bytes: int
    zero_copy: bool  # the pool's own page segments (get_page_buffer_meta), else its flat page

    @classmethod
    def of(cls, name: str, pool: Any, prefix: str, suffix: str) -> HostPool:
        try:
            first = torch.arange(pool.page_size, dtype=torch.int64)
            page_bytes, zero_copy = sum(flat_ints(pool.get_page_buffer_meta(first)[1])), True
        except Exception:  # no zero-copy metadata for this pool (class, layout, side states)
            page = pool.get_dummy_flat_data_page()
            page_bytes, zero_copy = page.numel() * page.element_size(), False
        mode = "segments" if zero_copy else "flat"
        identity = (f"{prefix}|{name}|{type(pool).__name__}|{getattr(pool, 'layout', '')}|"
                    f"{getattr(pool, 'dtype', '')}|{page_bytes}|{mode}|{suffix}")
        return cls(pool, identity, page_bytes, zero_copy)

    def parts(self, chunk_bytes: int) -> int:
        return -(-self.page_bytes // chunk_bytes)

    def chunk_keys(self, keys: list[str], chunk_bytes: int) -> list[bytes]:
        """Every page's parts' keys, page by page."""
        n = self.parts(chunk_bytes)
        return [key_digest(f"{self.identity}|{key}|{i}/{n}@{chunk_bytes}".encode())
                for key in keys for i in range(n)]

    def pages(self, host_indices: torch.Tensor, count: int, load: bool) -> tuple[list[Segments], list[Any]]:
        """Each page's segments, in the order its bytes are stored, and what must stay alive
        while they are used (the flat pages of a pool without zero-copy metadata)."""
        if self.zero_copy:
            pointers, sizes = self.pool.get_page_buffer_meta(host_indices)
            pieces = list(zip(flat_ints(pointers), flat_ints(sizes), strict=True))
            if len(pieces) % count:
                raise ValueError(f"{len(pieces)} buffer pieces for {count} pages")
            per = len(pieces) // count
            return [pieces[i * per : (i + 1) * per] for i in range(count)], []
        size = self.pool.page_size
        if load:
            flat = [self.pool.get_dummy_flat_data_page() for _ in range(count)]
        else:
            flat = [self.pool.get_data_page(int(host_indices[i * size].item()), flat=True).contiguous()
                    for i in range(count)]
        return [[(t.data_ptr(), t.numel() * t.element_size())] for t in flat], flat


def cut(page: Segments, chunk_bytes: int, pad: int) -> list[Segments]:
    """One page's segments cut into chunks of `chunk_bytes`, the last filled up from `pad`."""
    chunks: list[list[tuple[int, int]]] = [[]]
    room = chunk_bytes
    for address, size in page:
        while size:
            if not room:
                chunks.append([])
                room = chunk_bytes
            take = min(size, room)
            chunks[-1].append((address, take))
            address, size, room = address + take, size - take, room - take
    if room:
        chunks[-1].append((pad, room))
    return list(chunks)


class HybridPools:
    """The extra pools SGLang registered, and the v2 calls over them (the KV pool itself
    stays with the backend's v1 path). Never raises: a failure is logged and a miss."""

    def __init__(self, config: HiCacheStorageConfig, prefix: str) -> None:
        self.config = config
        self.prefix = prefix  # the model and its KV kind
        self.pools: dict[str, HostPool] = {}
        self._warned: set[str] = set()

    def rekey(self, prefix: str) -> None:
        """A new prefix (the weights' new generation): every registered pool's pages are
        keyed under it from now on."""
        self.prefix = prefix
        for name, host in list(self.pools.items()):
            self.register(name, host.pool)

    def register(self, name: str, pool: Any) -> None:
        # SGLang's Mamba state is split across TP ranks even where the model's MLA KV is not.
        replicated = self.config.is_mla_model and name != PoolName.MAMBA.value
        try:
            self.pools[name] = HostPool.of(name, pool, self.prefix, shard_suffix(self.config, replicated))
        except Exception:
            log.exception("kvstore: host pool %s has no page geometry it can store; its pages miss", name)

    def move(self, io: PageIO | None, transfer: PoolTransfer, load: bool) -> list[bool]:
        """batch_get_v2 / batch_set_v2 for one extra pool: a page is True once every part is."""
        keys = list(transfer.keys or [])
        host = self.pools.get(str(transfer.name))  # PoolName prints as its value
        if not keys:
            return []
        if host is None or io is None:
            self._warn(f"no-pool-{transfer.name}", "kvstore: no registered host pool (or no service) for "
                       "pool %s; its pages miss", transfer.name)
            return [False] * len(keys)
        if not load and not self.config.is_storage_writer and str(transfer.name) != PoolName.MAMBA.value:
            return [True] * len(keys)  # SGLang's rule: one writer per replicated shard
        expected = len(keys) * host.pool.page_size
        if transfer.host_indices is None or transfer.host_indices.numel() != expected:
            log.error("kvstore: %d host indices for %d pages of pool %s (want %d); counted as misses",
                      0 if transfer.host_indices is None else transfer.host_indices.numel(),
                      len(keys), transfer.name, expected)
            return [False] * len(keys)
        try:
            return self._move(io, host, keys, transfer.host_indices, load)
        except Exception:  # an exception would stop SGLang's prefetch/backup of the request
            log.exception("kvstore %s of %d pages of pool %s failed; counted as misses",
                          "load" if load else "save", len(keys), transfer.name)
            return [False] * len(keys)

    def _move(self, io: PageIO, host: HostPool, keys: list[str], indices: torch.Tensor,
              load: bool) -> list[bool]:
        pages, alive = host.pages(indices, len(keys), load)
        pad = torch.zeros(io.chunk_bytes, dtype=torch.uint8)  # saved as zeros; a load's padding lands here
        chunks = [chunk for page in pages for chunk in cut(page, io.chunk_bytes, pad.data_ptr())]
        done = (io.load if load else io.save)(host.chunk_keys(keys, io.chunk_bytes), chunks)
        n = host.parts(io.chunk_bytes)
        ok = [all(done[i * n : (i + 1) * n]) for i in range(len(keys))]
        if load and not host.zero_copy:
            size = host.pool.page_size
            for i, flat in enumerate(alive):
                if ok[i]:
                    host.pool.set_from_flat_data_page(int(indices[i * size].item()), flat)
        return ok

    def exists(self, io: PageIO | None, keys: list[str], kv_pages: int,
               transfers: list[PoolTransfer]) -> PoolTransferResult:
        """SGLang's batch_exists_v2 over the KV run `kv_pages` the backend found: each pool's
        policy keeps the prefix lengths it can restore; the hit is the longest all keep."""
        hit_count: dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in transfers:
            if not restorable:
                break
            if transfer.hit_policy not in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES):
                self._warn(f"policy-{transfer.hit_policy}", "kvstore: hit policy %s (pool %s) is not "
                           "supported; the lookup is a miss", transfer.hit_policy, transfer.name)
                return PoolTransferResult(0, {}, [])
            present = self._present(io, transfer.name, keys[:kv_pages])
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = present.index(False) if False in present else kv_pages
                pool_restorable = set(range(1, boundary + 1))
            else:
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                pool_restorable = {p for p in range(1, kv_pages + 1)
                                   if all(present[max(0, p - trailing) : p])}
                boundary = max(pool_restorable, default=0)
            if boundary:
                hit_count[transfer.name] = boundary
            restorable = [p for p in restorable if p in pool_restorable]
        return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)

    def _present(self, io: PageIO | None, name: Any, keys: list[str]) -> list[bool]:
        """Which of these pages the store holds whole (every part), in a lookup per missing
        page and per wave of present ones."""
        host = self.pools.get(str(name))
        present = [False] * len(keys)
        if host is None or io is None or not keys or host.page_bytes <= 0:  # no pages: nothing held
            return present
        n = host.parts(io.chunk_bytes)
        chunk_keys = host.chunk_keys(keys, io.chunk_bytes)
        per_wave = max(1, PRESENCE_WAVE // n) * n  # whole pages only
        page = 0
        try:
            while page < len(keys):
                wave = chunk_keys[page * n : page * n + per_wave]
                whole = io.present(wave) // n
                present[page : page + whole] = [True] * whole
                page += whole if whole * n == len(wave) else whole + 1
        except Exception:
            log.exception("kvstore lookup of pool %s failed; counted as misses", name)
        return present

    def _warn(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message, *args)
