"""Worker loads: chunks from the service's DRAM tier or window scattered into KV blocks.

Where the service shares its DRAM tier (this worker maps it read-only), a DRAM hit is
one copy: the service pins the chunk's slot (a lease), the layout copies it straight
from the slot into the blocks, and the lease is released at once (or, if this worker
dies or its connection drops, by the service). The rest, and every chunk where the
tier is not shared, goes through the window: the service fills window slots (DRAM
copy or O_DIRECT read, checksummed), then the layout scatters each verified chunk
into its blocks, in waves of half the window: a fetch thread has the service fill one
half while the other is scattered, so the service's copy and the scatter run at once.
A chunk that did not verify, went missing or timed out is reported by its block ids,
and the engine recomputes those tokens.
With `load_async`, loads run on a thread while the request waits outside the batch;
otherwise before the forward pass. Chunks already staged on the device (stages.py)
are copied from the pool instead of asked for.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from connectors.device_staging import DeviceStagingPool
from connectors.kv_layout import KVLayout
from connectors.link import ServiceLink
from connectors.plan import SKIP, Transfer
from kvstore.format.errors import KVStoreError
from kvstore.service.client import StoreClient
from kvstore.tiers.stats import Stats

log = logging.getLogger("vllm.kvstore.worker")


class LoadHandler:
    def __init__(self, layout: KVLayout, rank: int, make_client: Callable[[], StoreClient], stats: Stats,
                 load_async: bool, staging: DeviceStagingPool | None) -> None:
        self.layout = layout
        self.rank = rank
        self.stats = stats
        self.staging = staging
        self.link = ServiceLink(make_client)
        self.link.start()
        self._lock = threading.Lock()
        self._finished_loads: set[str] = set()
        self._loads_left: Counter[str] = Counter()  # a request's loads still running (one per group)
        self._failed_blocks: set[int] = set()
        self._load_pool = ThreadPoolExecutor(1, "kvstore-load") if load_async else None
        self._fetcher = ThreadPoolExecutor(1, "kvstore-fetch")  # the next wave's get

    def start_loads(self, loads: Sequence[Transfer], load_async: bool) -> None:
        """A request is reported finished once, after its last load (a hybrid model's
        groups load in transfers of their own)."""
        with self._lock:
            self._loads_left.update(t.req_id for t in loads)
        for transfer in loads:
            if load_async and self._load_pool is not None:
                self._load_pool.submit(self._load, transfer, True)
            else:
                self._load(transfer, False)

    def _load(self, transfer: Transfer, report_finished: bool) -> None:
        failed: list[int] = []
        try:
            keys = transfer.keys[self.rank]
            pending = [i for i in range(transfer.num_chunks)
                       if not self._load_staged(keys[i], transfer.blocks[i], transfer.group)]
            client = self.link.get() if pending else None
            if client is None:
                failed = [b for i in pending for b in transfer.blocks[i] if b != SKIP]
            else:
                load = self._load_leased if client.tier is not None else self._load_waves
                failed = load(client, [keys[i] for i in pending], [transfer.blocks[i] for i in pending],
                              transfer.group)
            self.stats.add("load.chunks", transfer.num_chunks)
            self._report_staging(transfer.num_chunks - len(pending), transfer.num_chunks)
        except Exception:  # never let a load bug kill the engine: recompute instead
            log.exception("kvstore load for %s failed; its tokens will be recomputed",
                          transfer.req_id)
            failed = [b for blocks in transfer.blocks for b in blocks if b != SKIP]
        with self._lock:
            if failed:
                self.stats.add("load.failed_blocks", len(failed))
                self._failed_blocks.update(failed)
            self._loads_left[transfer.req_id] -= 1
            if self._loads_left[transfer.req_id] <= 0:
                del self._loads_left[transfer.req_id]
                if report_finished:
                    self._finished_loads.add(transfer.req_id)

    def _load_leased(self, client: StoreClient, keys: list[bytes],
                     blocks: list[tuple[int, ...]], group: int = 0) -> list[int]:
        """Copy the DRAM hits among `keys` straight from the tier into their blocks, a
        window's worth of pins at a time; the others through the window. Returns the
        block ids that did not load."""
        failed: list[int] = []
        for start in range(0, len(keys), client.slots):
            wave = range(start, min(start + client.slots, len(keys)))
            try:
                lease, offsets = client.pin([keys[i] for i in wave])
            except KVStoreError as exc:
                log.warning("kvstore pin failed (%s); recomputing", exc)
                self.link.fail()
                return failed + [b for i in range(start, len(keys)) for b in blocks[i] if b != SKIP]
            try:
                for i, offset in zip(wave, offsets, strict=True):
                    if offset >= 0:
                        self.layout.scatter(client.tier_payload(offset), blocks[i], group)
            finally:
                self._unpin(client, lease)
            rest = [i for i, offset in zip(wave, offsets, strict=True) if offset < 0]
            if rest:
                failed += self._load_waves(client, [keys[i] for i in rest], [blocks[i] for i in rest], group)
        return failed

    def _unpin(self, client: StoreClient, lease: int) -> None:
        try:
            client.unpin([lease])
        except KVStoreError as exc:  # dropping the connection releases every pin it holds
            log.warning("kvstore unpin failed (%s); reconnecting", exc)
            self.link.fail()

    def _load_waves(self, client: StoreClient, keys: list[bytes],
                    blocks: list[tuple[int, ...]], group: int = 0) -> list[int]:
        """Fetch and scatter `keys` in waves of half the window, the next wave's fetch
        running while this one is scattered. Returns the block ids that did not load."""
        half = max(1, client.slots // 2)
        ahead = client.slots >= 2  # a window of one slot cannot fetch ahead
        waves = [range(start, min(start + half, len(keys))) for start in range(0, len(keys), half)]

        def fetch(k: int) -> list[bool]:
            first_slot = half * (k % 2) if ahead else 0
            return self._get(client, [keys[i] for i in waves[k]], first_slot)

        failed: list[int] = []
        next_fetch = self._fetcher.submit(fetch, 0)
        try:
            for k, wave in enumerate(waves):
                found = next_fetch.result()
                if ahead and k + 1 < len(waves):
                    next_fetch = self._fetcher.submit(fetch, k + 1)
                first_slot = half * (k % 2) if ahead else 0
                for slot, (i, ok) in enumerate(zip(wave, found, strict=True), start=first_slot):
                    if ok:
                        self.layout.scatter(client.slot(slot), blocks[i], group)
                    else:
                        failed.extend(b for b in blocks[i] if b != SKIP)
                if not ahead and k + 1 < len(waves):
                    next_fetch = self._fetcher.submit(fetch, k + 1)
        finally:
            next_fetch.result()  # never leave a fetch writing the window (bounded by its deadline)
        return failed

    def _report_staging(self, staged: int, loaded: int) -> None:
        """Tell the service how much of this load the device pool served (its counters
        staging.hits / staging.loaded_chunks are the device tier's resident fraction)."""
        client = self.link.get() if self.staging is not None else None
        if client is None:
            return
        try:
            client.count({"staging.hits": staged, "staging.loaded_chunks": loaded})
        except KVStoreError as exc:
            log.debug("kvstore: staging counters not reported (%s)", exc)

    def _load_staged(self, key: bytes, blocks: Sequence[int], group: int = 0) -> bool:
        """Copy a staged chunk from the device pool into its blocks; False if not staged."""
        slot = self.staging.take(key) if self.staging is not None else None
        if slot is None:
            return False
        assert self.staging is not None
        try:
            self.layout.scatter(self.staging.slot(slot), blocks, group)
        finally:
            self.staging.release(slot)
        self.stats.add("staging.hits")
        return True

    def _get(self, client: StoreClient, keys: Sequence[bytes], first_slot: int) -> list[bool]:
        try:
            return client.get(keys, range(first_slot, first_slot + len(keys)))
        except KVStoreError as exc:
            log.warning("kvstore get failed (%s); recomputing", exc)
            self.link.fail()
            return [False] * len(keys)

    def take_finished_loads(self) -> set[str]:
        with self._lock:
            done, self._finished_loads = self._finished_loads, set()
        return done

    def take_failed_blocks(self) -> set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def close(self) -> None:
        for pool in (self._load_pool, self._fetcher):
            if pool is not None:
                pool.shutdown(wait=True)
        self.link.close()
