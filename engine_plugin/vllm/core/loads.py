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
is reported failed instead, with its finish, and the engine recomputes it whole (what is
reported, and when: load_reports.py).
An async load (Transfer.load_async, as the scheduler decided per request) runs on a
thread while the request waits outside the batch; the others before the forward pass.
Chunks already staged on the device (stages.py) are copied from the pool instead of
asked for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from connectors.link import ServiceLink
from connectors.transfer import Fetched, Transfers
from connectors.worker_threads import pool
from engine_plugin.vllm.core.device_staging import DeviceStagingPool
from engine_plugin.vllm.core.kv_layout import KVLayout
from engine_plugin.vllm.core.load_reports import LoadReports
from engine_plugin.vllm.core.plan import SKIP, Transfer
from kvstore.format.errors import KVStoreError
from kvstore.service.client import StoreClient
from kvstore.service.client_types import Stats

log = logging.getLogger("vllm.kvstore.worker")


class LoadHandler:
    def __init__(self, layout: KVLayout, rank: int, make_client: Callable[[], StoreClient], stats: Stats,
                 reports: LoadReports, staging: DeviceStagingPool | None) -> None:
        self.layout = layout
        self.rank = rank
        self.stats = stats
        self.reports = reports
        self.staging = staging
        self.link = ServiceLink(make_client)
        self.link.start()
        self.transfers = Transfers(self.link, "load")
        self._load_pool = pool("kvstore-load")  # async loads

    def start_loads(self, loads: Sequence[Transfer], step: int = 0) -> None:
        """Async loads go to the load pool, the rest run here, before the forward pass; once
        they have, plan `step` is reported loaded (LoadReports says what is reported when)."""
        self.reports.started([t.req_id for t in loads])
        try:
            for transfer in loads:
                if transfer.load_async:
                    self._load_pool.submit(self._load, transfer, True)
                else:
                    self._load(transfer, False)
        finally:
            if any(not t.load_async for t in loads):
                self.reports.step_loaded(step)

    def _load(self, transfer: Transfer, report_finished: bool) -> None:
        every = [b for blocks in transfer.blocks for b in blocks if b != SKIP]
        try:
            # No keys: given up by the scheduler after a fault (SchedulerCore.abandon).
            failed = self._load_chunks(transfer) if transfer.keys else every
        except Exception:  # never let a load bug kill the engine: recompute instead
            log.exception("kvstore load for %s failed; its tokens will be recomputed",
                          transfer.req_id)
            failed = every
        self.reports.ended(transfer.req_id, failed, report_finished, given_up=not transfer.keys)

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
        failed = [b for i in direct if not held(i) for b in blocks[i] if b != SKIP]
        self.reports.copied({"load.leased_chunks": len(direct), "load.leased_copy_us": spent_us})
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

    def close(self) -> None:
        self._load_pool.shutdown(wait=True)
        self.transfers.close()
