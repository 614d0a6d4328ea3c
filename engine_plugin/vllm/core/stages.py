"""Device staging ahead of loads: chunks a request's arrival asked for, fetched into the
device pool (engine_plugin/vllm/core/device_staging.py) by a thread of their own, so the load
copies them device to device instead of asking the service. The chunks come from the
service's window (transfer.py), the next wave's fetch overlapping this wave's copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial

from connectors.link import ServiceLink
from connectors.transfer import Fetched, Transfers
from connectors.worker_threads import pool
from engine_plugin.vllm.core.device_staging import DeviceStagingPool
from engine_plugin.vllm.core.plan import Stage
from kvstore.service.client import StoreClient
from kvstore.service.client_types import Stats

log = logging.getLogger("vllm.kvstore.worker")


class StageHandler:
    def __init__(self, rank: int, make_client: Callable[[], StoreClient], stats: Stats,
                 staging: DeviceStagingPool) -> None:
        self.rank = rank
        self.stats = stats
        self.staging = staging
        self.transfers = Transfers(ServiceLink(make_client), "stage")
        self._stage_pool = pool("kvstore-stage")

    def start_stages(self, stages: Sequence[Stage]) -> Future[None] | None:
        """Stage each request's chunks on the staging thread; the future is done when the
        last one is (None for no stages)."""
        done = None
        for stage in stages:
            done = self._stage_pool.submit(self._stage, stage)
        return done

    def _stage(self, stage: Stage) -> None:
        """Fetch a request's chunks into the device pool before its load needs them."""
        try:
            client = self.transfers.link.get()
            if client is not None:
                keys = [k for k in stage.keys[self.rank] if k not in self.staging]
                self.transfers.fetch_waves(client, keys, partial(self._place, client, keys))
        except Exception:  # staging is an optimisation: the load falls back to the service
            log.exception("kvstore staging for %s failed", stage.req_id)

    def _place(self, client: StoreClient, keys: list[bytes], wave: range, fetched: Fetched) -> None:
        """Copy one fetched wave's chunks into the device pool."""
        found = [(keys[i], source) for j, i in enumerate(wave)
                 if (source := fetched.source(client.memory, j)) is not None]
        staged, evicted = self.staging.stage([key for key, _ in found], [source for _, source in found])
        self.stats.add("staging.chunks", staged)
        self.stats.add("staging.evicted_unused", evicted)

    def close(self) -> None:
        self._stage_pool.shutdown(wait=True)
        self.transfers.close()
