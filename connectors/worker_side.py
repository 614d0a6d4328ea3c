"""Worker-side transfers: chunks between the store's staging window and KV blocks.

Loads: the service fills window slots (DRAM copy or O_DIRECT read, checksummed),
then the layout scatters each verified chunk into its blocks, in waves of half the
window: a fetch thread has the service fill one half while the other is scattered,
so the service's copy and the scatter run at once. A chunk that did
not verify, went missing or timed out is reported by its block ids, and the
engine recomputes those tokens. With `load_async`, loads run on a thread while
the request waits outside the batch; otherwise before the forward pass.

With a device staging pool (connectors/device_staging.py), chunks a request's arrival
asked to stage are fetched ahead by a thread of their own, and a load copies those
from the pool (device to device), asking the service only for the others.

Saves copy out within their step, since a block may be reused once the step ends:
each chunk's blocks are gathered into a free window slot, and a writer thread hands
the slots to the service (write behind), in waves of at most half the window so the
copy-out of one wave overlaps the write of the previous. A step that computed more
chunks than the window holds waits for slots to come back, at most
`save_window_wait_s` per step (and not at all while the writer is stuck, i.e. since
a wait ran out no slot came back); what does not fit is dropped and counted
(`save.dropped`, sent to the service's counters). A dropped save is only a future miss.
Each save is reported done (stored or given up) by its save_id, in the writer's order,
so the scheduler knows when its chunks stopped being in flight.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from connectors.device_staging import DeviceStagingPool
from connectors.link import ServiceLink
from connectors.plan import SKIP, Stage, Transfer
from kvstore.format.errors import KVStoreError
from kvstore.service.client import StoreClient
from kvstore.tiers.stats import Stats

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


@dataclass(frozen=True)
class _SaveDone:
    """Queued after a save's writes: the save is over once the writer reaches it."""

    save_id: int
    dropped: int  # chunks that never got a window slot
    client: StoreClient | None  # the saver's client, to report counters through


class WorkerCore:
    def __init__(self, layout: KVLayout, rank: int, make_client: Callable[[], StoreClient],
                 load_async: bool, staging: DeviceStagingPool | None = None,
                 save_window_wait_s: float = 2.0) -> None:
        self.layout = layout
        self.rank = rank
        self.save_window_wait_s = save_window_wait_s
        self.stats = Stats()
        self.staging = staging
        self._stager = ServiceLink(make_client) if staging is not None else None
        self._stage_pool = ThreadPoolExecutor(1, "kvstore-stage") if staging is not None else None
        self._loader = ServiceLink(make_client)
        self._saver = ServiceLink(make_client)
        self._loader.start()
        self._saver.start()
        self._lock = threading.Lock()
        self._finished_loads: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._load_pool = ThreadPoolExecutor(1, "kvstore-load") if load_async else None
        self._fetcher = ThreadPoolExecutor(1, "kvstore-fetch")  # the next wave's get
        # Free slots of one client's window; a new client (after a failure) brings a
        # new window, and slots of the old one are never handed out again.
        self._window_owner: StoreClient | None = None
        self._free_slots: list[int] = []
        self._slot_freed = threading.Condition(self._lock)
        self._stalled = False  # a wait for a slot ran out and no slot has come back since
        self._done_saves: list[int] = []
        self._unreported: Counter[str] = Counter()  # counters not yet sent to the service
        self._writes: queue.Queue[_Write | _SaveDone | None] = queue.Queue()
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

    def start_stages(self, stages: Sequence[Stage]) -> Future[None] | None:
        """Stage each request's chunks on the staging thread; the future is done when the
        last one is (None without a pool)."""
        done = None
        if self._stage_pool is not None:
            for stage in stages:
                done = self._stage_pool.submit(self._stage, stage)
        return done

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
            if client is None:
                failed = [b for i in pending for b in transfer.blocks[i] if b != SKIP]
            else:
                failed = self._load_waves(client, [keys[i] for i in pending],
                                          [transfer.blocks[i] for i in pending])
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

    def _load_waves(self, client: StoreClient, keys: list[bytes],
                    blocks: list[tuple[int, ...]]) -> list[int]:
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
                        self.layout.scatter(client.slot(slot), blocks[i])
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

    def _get(self, client: StoreClient, keys: Sequence[bytes], first_slot: int) -> list[bool]:
        try:
            return client.get(keys, range(first_slot, first_slot + len(keys)))
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
        """Copy each chunk out of its blocks into a window slot, queueing the writes in
        waves; wait for slots at most save_window_wait_s in all, then drop the rest.
        Runs on the engine's thread, so it never connects: a save without a connected
        saver is dropped, and the writer thread reconnects (the hello alone may take
        the I/O deadline on a hung service)."""
        client = self._saver.peek()
        if client is not None:
            with self._lock:
                if self._window_owner is not client:
                    self._window_owner, self._free_slots = client, list(range(client.slots))
                    self._stalled = False
        deadline = time.monotonic() + self.save_window_wait_s
        for transfer in saves:
            keys = transfer.keys[self.rank]
            done = 0
            while client is not None and done < transfer.num_chunks:
                slots = self._take_slots(client, transfer.num_chunks - done, deadline)
                if not slots:
                    break
                for slot, blocks in zip(slots, transfer.blocks[done:], strict=False):
                    self.layout.gather(blocks, client.slot(slot))
                parent = keys[done - 1] if done else transfer.parents[self.rank]
                self._writes.put(_Write(client, keys[done : done + len(slots)], slots, parent))
                done += len(slots)
            self._writes.put(_SaveDone(transfer.save_id, transfer.num_chunks - done, client))

    def _take_slots(self, client: StoreClient, wanted: int, deadline: float) -> list[int]:
        """Up to `wanted` free slots of `client`'s window (at most half of it), waiting
        for the writer to free some until `deadline`; none past it or while stalled."""
        with self._slot_freed:
            while not self._free_slots and not self._stalled and self._window_owner is client:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._slot_freed.wait(remaining):
                    self._stalled = True
            if self._window_owner is not client:
                return []
            count = min(wanted, len(self._free_slots), max(1, client.slots // 2))
            return [self._free_slots.pop() for _ in range(count)]

    def take_done_saves(self) -> list[int]:
        """save_ids whose writes are over since the last call (for the scheduler)."""
        with self._lock:
            done, self._done_saves = self._done_saves, []
        return done

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            if isinstance(item, _SaveDone):
                self._finish_save(item)
            else:
                self._write(item)

    def _write(self, write: _Write) -> None:
        try:
            stored = write.client.put(write.keys, write.slots, write.parent)
            self.stats.add("save.chunks", sum(stored))
        except Exception as exc:  # a failed save is a future miss, never an engine crash
            log.warning("kvstore put failed (%s); %d chunks not saved", exc, len(write.keys))
            self._saver.fail()
        with self._slot_freed:
            if self._window_owner is write.client:
                self._free_slots.extend(write.slots)
                self._stalled = False
                self._slot_freed.notify_all()

    def _finish_save(self, done: _SaveDone) -> None:
        """Report the save done, count what was dropped, and send pending counters to the
        service (reconnecting the saver if it has no client)."""
        with self._lock:
            self._done_saves.append(done.save_id)
            if done.dropped:
                self.stats.add("save.dropped", done.dropped)
                self._unreported["save.dropped"] += done.dropped
            counters = dict(self._unreported)
        if done.dropped:
            log.warning("kvstore: %d chunks of a save dropped (no save window slot within "
                        "save_window_wait_s=%g s, or no service)", done.dropped, self.save_window_wait_s)
        client = done.client if done.client is not None else self._saver.get()
        if counters and client is not None:
            try:
                client.count(counters)
            except KVStoreError as exc:
                log.debug("kvstore: save counters not reported yet (%s)", exc)
            else:
                with self._lock:
                    self._unreported.subtract(counters)
                    self._unreported = +self._unreported

    def close(self) -> None:
        """Drain queued saves (bounded wait), then release both connections."""
        if not self._writer.is_alive():
            return
        self._writes.put(None)
        self._writer.join(timeout=30)
        log.info("kvstore worker %d: %s", self.rank, self.stats.snapshot())
        for pool in (self._load_pool, self._stage_pool, self._fetcher):
            if pool is not None:
                pool.shutdown(wait=True)
        for link in (self._loader, self._saver, self._stager):
            if link is not None:
                link.close()
