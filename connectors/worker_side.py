"""Worker-side transfers: chunks between the store's staging window and KV blocks.

Loads: the service fills window slots (DRAM copy or O_DIRECT read, checksummed),
then the layout scatters each verified chunk into its blocks. A chunk that did
not verify, went missing or timed out is reported by its block ids, and the
engine recomputes those tokens. With `load_async`, loads run on a thread while
the request waits outside the batch; otherwise before the forward pass.

With a device staging pool (connectors/device_staging.py), chunks a request's arrival
asked to stage are fetched ahead by a thread of their own, and a load copies those
from the pool (device to device), asking the service only for the others.

Saves never block the forward pass beyond one copy: after the step, each chunk's
blocks are gathered into a free window slot (copy out), and a writer thread hands
the slots to the service (write behind). With no free slot the rest of that run
is dropped and counted: a dropped save is only a future miss.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from connectors.device_staging import DeviceStagingPool
from connectors.link import ServiceLink
from connectors.plan import SKIP, Stage, Transfer
from kvstore.client import StoreClient
from kvstore.errors import KVStoreError
from kvstore.stats import Stats

log = logging.getLogger("vllm.kvstore.worker")


class KVLayout(Protocol):
    """How one worker's paged KV tensors turn into chunk bytes and back."""

    chunk_bytes: int

    def gather(self, blocks: Sequence[int], out: memoryview) -> None: ...

    def scatter(self, src: memoryview | torch.Tensor, blocks: Sequence[int]) -> None: ...


@dataclass(frozen=True)
class _Write:
    client: StoreClient
    keys: tuple[bytes, ...]
    slots: list[int]
    parent: bytes | None


class WorkerCore:
    def __init__(self, layout: KVLayout, rank: int, make_client: Callable[[], StoreClient],
                 load_async: bool, staging: DeviceStagingPool | None = None) -> None:
        self.layout = layout
        self.rank = rank
        self.stats = Stats()
        self.staging = staging
        self._stager = ServiceLink(make_client) if staging is not None else None
        self._stage_pool = ThreadPoolExecutor(1, "kvstore-stage") if staging is not None else None
        self._loader = ServiceLink(make_client)
        self._saver = ServiceLink(make_client)
        self._loader.start()
        self._lock = threading.Lock()
        self._finished_loads: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._load_pool = ThreadPoolExecutor(1, "kvstore-load") if load_async else None
        # Free slots of one client's window; a new client (after a failure) brings a
        # new window, and slots of the old one are never handed out again.
        self._window_owner: StoreClient | None = None
        self._free_slots: list[int] = []
        self._writes: queue.Queue[_Write | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kvstore-save", daemon=True)
        self._writer.start()
        # Engines do not always call shutdown before exiting; queued saves must still land.
        atexit.register(self.close)

    # -- loads -----------------------------------------------------------------------

    def start_loads(self, loads: Sequence[Transfer], load_async: bool) -> None:
        for transfer in loads:
            if load_async and self._load_pool is not None:
                self._load_pool.submit(self._load, transfer, True)
            else:
                self._load(transfer, False)

    def start_stages(self, stages: Sequence[Stage]) -> None:
        if self._stage_pool is not None:
            for stage in stages:
                self._stage_pool.submit(self._stage, stage)

    def _stage(self, stage: Stage) -> None:
        """Fetch a request's chunks into the device pool before its load needs them."""
        assert self.staging is not None and self._stager is not None
        try:
            client = self._stager.get()
            keys = [k for k in stage.keys[self.rank] if k not in self.staging]
            if client is None:
                return
            for start in range(0, len(keys), client.slots):
                wave = keys[start : start + client.slots]
                found = client.get(wave, range(len(wave)))
                served = [i for i, ok in enumerate(found) if ok]
                staged, evicted = self.staging.stage([wave[i] for i in served],
                                                     [client.slot(i) for i in served])
                self.stats.add("staging.chunks", staged)
                self.stats.add("staging.evicted_unused", evicted)
        except Exception as exc:  # staging is an optimisation: the load falls back to the service
            log.warning("kvstore staging for %s failed (%s)", stage.req_id, exc)
            if self._stager is not None:
                self._stager.fail()

    def _load(self, transfer: Transfer, report_finished: bool) -> None:
        failed: list[int] = []
        try:
            keys = transfer.keys[self.rank]
            pending = [i for i in range(transfer.num_chunks) if not self._load_staged(keys[i],
                                                                                      transfer.blocks[i])]
            client = self._loader.get() if pending else None
            wave = client.slots if client else 1
            for start in range(0, len(pending), wave):
                chunks = pending[start : start + wave]
                found = self._get(client, [keys[i] for i in chunks])
                for slot, (i, ok) in enumerate(zip(chunks, found, strict=True)):
                    if ok and client is not None:
                        self.layout.scatter(client.slot(slot), transfer.blocks[i])
                    else:
                        failed.extend(b for b in transfer.blocks[i] if b != SKIP)
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
            if report_finished:
                self._finished_loads.add(transfer.req_id)

    def _report_staging(self, staged: int, loaded: int) -> None:
        """Tell the service how much of this load the device pool served (its counters
        staging.hits / staging.loaded_chunks are the device tier's resident fraction)."""
        client = self._loader.get() if self.staging is not None else None
        if client is None:
            return
        try:
            client.count({"staging.hits": staged, "staging.loaded_chunks": loaded})
        except KVStoreError as exc:
            log.debug("kvstore: staging counters not reported (%s)", exc)

    def _load_staged(self, key: bytes, blocks: Sequence[int]) -> bool:
        """Copy a staged chunk from the device pool into its blocks; False if not staged."""
        slot = self.staging.take(key) if self.staging is not None else None
        if slot is None:
            return False
        assert self.staging is not None
        try:
            self.layout.scatter(self.staging.slot(slot), blocks)
        finally:
            self.staging.release(slot)
        self.stats.add("staging.hits")
        return True

    def _get(self, client: StoreClient | None, keys: Sequence[bytes]) -> list[bool]:
        if client is None:
            return [False] * len(keys)
        try:
            return client.get(keys, range(len(keys)))
        except KVStoreError as exc:
            log.warning("kvstore get failed (%s); recomputing", exc)
            self._loader.fail()
            return [False] * len(keys)

    def take_finished_loads(self) -> set[str]:
        with self._lock:
            done, self._finished_loads = self._finished_loads, set()
        return done

    def take_failed_blocks(self) -> set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # -- saves -----------------------------------------------------------------------

    def save(self, saves: Sequence[Transfer]) -> None:
        """Copy each chunk out of its blocks into a free window slot; queue the write."""
        client = self._saver.get()
        if client is None:
            self.stats.add("save.dropped", sum(t.num_chunks for t in saves))
            return
        with self._lock:
            if self._window_owner is not client:
                self._window_owner, self._free_slots = client, list(range(client.slots))
        for transfer in saves:
            with self._lock:
                count = min(transfer.num_chunks, len(self._free_slots))
                slots = [self._free_slots.pop() for _ in range(count)]
            for slot, blocks in zip(slots, transfer.blocks, strict=False):
                self.layout.gather(blocks, client.slot(slot))
            if count < transfer.num_chunks:
                self.stats.add("save.dropped", transfer.num_chunks - count)
            if count:
                keys = transfer.keys[self.rank][:count]
                self._writes.put(_Write(client, keys, slots, transfer.parents[self.rank]))

    def _write_loop(self) -> None:
        while (write := self._writes.get()) is not None:
            try:
                stored = write.client.put(write.keys, write.slots, write.parent)
                self.stats.add("save.chunks", sum(stored))
            except Exception as exc:  # a failed save is a future miss, never an engine crash
                log.warning("kvstore put failed (%s); %d chunks not saved", exc, len(write.keys))
                self._saver.fail()
            with self._lock:
                if self._window_owner is write.client:
                    self._free_slots.extend(write.slots)
            self._writes.task_done()

    def close(self) -> None:
        """Drain queued saves (bounded wait), then release both connections."""
        if not self._writer.is_alive():
            return
        self._writes.put(None)
        self._writer.join(timeout=30)
        log.info("kvstore worker %d: %s", self.rank, self.stats.snapshot())
        for pool in (self._load_pool, self._stage_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        for link in (self._loader, self._saver, self._stager):
            if link is not None:
                link.close()
