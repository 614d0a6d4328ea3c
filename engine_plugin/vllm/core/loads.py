"""Worker loads: chunks from the service's DRAM tier or window scattered into KV blocks.

Where this worker maps the service's DRAM tier (read-only), the chunks the scheduler's
lookup leased for this load (Transfer.leased) are copied straight from their pinned slots
into the blocks, with no request to the service: the record's key is checked at its
offset before and after the copy (the pin is the scheduler connection's, and goes with
it), and one that changed is a failed chunk, recomputed. The rest come through
transfer.py: a DRAM hit is one copy out of its pinned slot (a disk hit is read into a
DRAM slot and verified there first); what DRAM cannot hold, and every chunk where the
tier is not shared, is scattered from the window slot the service filled. They run in
waves of half the window, the next wave's fetch overlapping this wave's scatter, so the
service's disk reads and the scatter overlap.
A chunk that did not verify, went missing or timed out is reported by its block ids,
and the engine recomputes those tokens; with `fail_requests` (a model with several KV
cache groups, whose block ids are unique only within a group), an async load's request
is reported failed instead, with its finish, and the engine recomputes it whole.
An async load (Transfer.load_async, as the scheduler decided per request) runs on a
thread while the request waits outside the batch; the others before the forward pass.
Chunks already staged on the device (stages.py) are copied from the pool instead of
asked for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from connectors.link import ServiceLink
from connectors.transfer import Fetched, Transfers
from connectors.worker_threads import pool
from engine_plugin.vllm.core.device_staging import DeviceStagingPool
from engine_plugin.vllm.core.kv_layout import KVLayout
from engine_plugin.vllm.core.plan import SKIP, Transfer
from kvstore.format.errors import KVStoreError
from kvstore.service.client import StoreClient
from kvstore.service.client_types import Stats

log = logging.getLogger("vllm.kvstore.worker")


class LoadHandler:
    def __init__(self, layout: KVLayout, rank: int, make_client: Callable[[], StoreClient], stats: Stats,
                 staging: DeviceStagingPool | None, fail_requests: bool = False) -> None:
        self.layout = layout
        self.rank = rank
        self.stats = stats
        self.staging = staging
        self.fail_requests = fail_requests
        self.link = ServiceLink(make_client)
        self.link.start()
        self.transfers = Transfers(self.link, "load")
        self._lock = threading.Lock()
        self._finished_loads: set[str] = set()  # async loads done, not yet taken
        self._failed_loads: set[str] = set()  # of those, the ones of which a transfer failed
        self._loads_left: Counter[str] = Counter()  # a request's loads still running (one per group)
        self._failing: set[str] = set()  # requests still loading, of which one transfer failed
        self._failed_blocks: set[int] = set()
        self._loaded_steps: list[int] = []  # plans whose sync loads ran, not yet taken
        self._unreported: Counter[str] = Counter()  # for the service, by way of the scheduler
        self._load_pool = pool("kvstore-load")  # async loads

    def start_loads(self, loads: Sequence[Transfer], step: int = 0) -> None:
        """An async load's request is reported finished once, after its last transfer (a
        hybrid model's groups load in transfers of their own), and with `fail_requests`
        failed in that same take if one of them failed (take_finished_loads); every other
        failure is reported by its blocks (a sync load's request is never reported). Plan
        `step`'s sync loads run here, before the forward pass; once they have, the step
        is reported (take_loaded_steps): the scheduler's leases for them may go."""
        with self._lock:
            self._loads_left.update(t.req_id for t in loads)
        try:
            for transfer in loads:
                if transfer.load_async:
                    self._load_pool.submit(self._load, transfer, True)
                else:
                    self._load(transfer, False)
        finally:
            if any(not t.load_async for t in loads):
                with self._lock:
                    self._loaded_steps.append(step)

    def _load(self, transfer: Transfer, report_finished: bool) -> None:
        every = [b for blocks in transfer.blocks for b in blocks if b != SKIP]
        try:
            # No keys: given up by the scheduler after a fault (SchedulerCore.abandon).
            failed = self._load_chunks(transfer) if transfer.keys else every
        except Exception:  # never let a load bug kill the engine: recompute instead
            log.exception("kvstore load for %s failed; its tokens will be recomputed",
                          transfer.req_id)
            failed = every
        req_id, per_request = transfer.req_id, self.fail_requests and report_finished
        with self._lock:
            if failed:
                self.stats.add("load.failed_blocks", len(failed))
                if not per_request:
                    self._failed_blocks.update(failed)
            if per_request and (failed or not transfer.keys):  # a given-up load fails, blocks or none
                self._failing.add(req_id)
            self._loads_left[req_id] -= 1
            if self._loads_left[req_id] <= 0:
                del self._loads_left[req_id]
                if report_finished:
                    self._finished_loads.add(req_id)
                    if req_id in self._failing:
                        self._failed_loads.add(req_id)
                self._failing.discard(req_id)

    def _load_chunks(self, transfer: Transfer) -> list[int]:
        """Load one transfer (from the device pool where staged, else through the service);
        the block ids that did not load."""
        keys = transfer.keys[self.rank]
        pending = [i for i in range(transfer.num_chunks)
                   if not self._load_staged(keys[i], transfer.blocks[i], transfer.group)]
        client = self.link.get() if pending else None
        if client is None:
            failed = [b for i in pending for b in transfer.blocks[i] if b != SKIP]
        else:
            leased = transfer.leased[self.rank] if transfer.leased else ()
            failed, pending = self._load_leased(client, keys, transfer.blocks, leased, pending,
                                                transfer.group)
            failed += self._load_waves(client, [keys[i] for i in pending],
                                       [transfer.blocks[i] for i in pending], transfer.group)
        self.stats.add("load.chunks", transfer.num_chunks)
        self._report_staging(transfer.num_chunks - len(pending), transfer.num_chunks)
        return failed

    def _load_leased(self, client: StoreClient, keys: Sequence[bytes], blocks: Sequence[tuple[int, ...]],
                     leased: Sequence[int], pending: list[int], group: int) -> tuple[list[int], list[int]]:
        """Copy the chunks among `pending` that the scheduler leased (`leased[i]`: the
        payload's offset in the tier) and that the tier still holds, with no request; (the
        block ids that did not load, the chunks left to fetch)."""
        def held(i: int) -> bool:
            return i < len(leased) and leased[i] >= 0 and client.memory.tier_holds(leased[i], keys[i])

        direct = [i for i in pending if held(i)]
        if not direct:
            return [], pending
        began = time.perf_counter()
        self.layout.scatter([(client.memory.tier_payload(leased[i]), blocks[i]) for i in direct], group)
        spent_us = round((time.perf_counter() - began) * 1e6)
        copied = {"load.leased_chunks": len(direct), "load.leased_copy_us": spent_us}
        failed = [b for i in direct if not held(i) for b in blocks[i] if b != SKIP]
        for name, amount in copied.items():
            self.stats.add(name, amount)
        with self._lock:
            self._unreported.update(copied)
        chosen = set(direct)
        return failed, [i for i in pending if i not in chosen]

    def _load_waves(self, client: StoreClient, keys: list[bytes],
                    blocks: list[tuple[int, ...]], group: int = 0) -> list[int]:
        """Fetch and scatter `keys` in waves (transfer.py: the next wave's fetch runs while
        this one is scattered). Returns the block ids that did not load."""
        failed: list[int] = []

        def scatter(wave: range, fetched: Fetched) -> None:
            found = [(j, fetched.source(client.memory, j), blocks[i]) for j, i in enumerate(wave)]
            present = [(j, source, ids) for j, source, ids in found if source is not None]
            verdicts = self.layout.scatter([(source, ids) for _, source, ids in present], group,
                                           [fetched.check(j) for j, _, _ in present])
            for (j, _, ids), ok in zip(present, verdicts, strict=True):
                if fetched.check(j) is not None:  # a disk hit verified as it was copied: one pass
                    (fetched.good if ok else fetched.bad).append(keys[wave[j]])
                if not ok:
                    self.stats.add("load.bad_checksum")
                    failed.extend(b for b in ids if b != SKIP)
            failed.extend(b for _, source, ids in found if source is None for b in ids if b != SKIP)

        self.transfers.fetch_waves(client, keys, scatter, self.layout.checks_copies)
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
            self.layout.scatter([(self.staging.slot(slot), blocks)], group)
        finally:
            self.staging.release(slot)
        self.stats.add("staging.hits")
        return True

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """(requests whose async loads are all done, those of them of which a load failed:
        with `fail_requests` only) since the last take, taken together: a failure is never
        reported after its finish."""
        with self._lock:
            done, self._finished_loads = self._finished_loads, set()
            failed, self._failed_loads = self._failed_loads, set()
        return done, failed

    def take_failed_blocks(self) -> set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def take_loaded_steps(self) -> list[int]:
        """The plans whose sync loads ran since the last take."""
        with self._lock:
            steps, self._loaded_steps = self._loaded_steps, []
        return steps

    def take_counters(self) -> dict[str, int]:
        """What the leased copies since the last take moved and took (chunks, microseconds):
        they ride to the scheduler with the step's report, and from it to the service with
        the leases it gives back (no request of their own)."""
        with self._lock:
            counters, self._unreported = dict(self._unreported), Counter()
        return counters

    def close(self) -> None:
        self._load_pool.shutdown(wait=True)
        self.transfers.close()
