"""Device staging ahead of loads: chunks a request's arrival asked for, fetched into the
device pool (connectors/device_staging.py) by a thread of their own, so the load
copies them device to device instead of asking the service.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from connectors.device_staging import DeviceStagingPool
from connectors.link import ServiceLink
from connectors.plan import Stage
from kvstore.service.client import StoreClient
from kvstore.tiers.stats import Stats

log = logging.getLogger("vllm.kvstore.worker")


class StageHandler:
    def __init__(self, rank: int, make_client: Callable[[], StoreClient], stats: Stats,
                 staging: DeviceStagingPool) -> None:
        self.rank = rank
        self.stats = stats
        self.staging = staging
        self.link = ServiceLink(make_client)
        self._stage_pool = ThreadPoolExecutor(1, "kvstore-stage")

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
            client = self.link.get()
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
            self.link.fail()

    def close(self) -> None:
        self._stage_pool.shutdown(wait=True)
        self.link.close()
