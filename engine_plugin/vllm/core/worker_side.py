"""Worker side of the connector: a small dispatcher over loads, saves and device staging.

Each concern has its own handler, its own connection to the service and its own
threads: loads.py (window -> KV blocks), saves.py (KV blocks -> window, written
behind), stages.py (chunks fetched into the device pool ahead of their load); what the
loads have to tell the engine and the scheduler waits in load_reports.py. They share one
set of counters, logged when the worker closes.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial

from engine_plugin.vllm.core.device_staging import DeviceStagingPool
from engine_plugin.vllm.core.kv_layout import KVLayout
from engine_plugin.vllm.core.load_reports import LoadReports
from engine_plugin.vllm.core.loads import LoadHandler
from engine_plugin.vllm.core.plan import Stage, Transfer
from engine_plugin.vllm.core.saves import SaveHandler
from engine_plugin.vllm.core.stages import StageHandler
from kvstore.service.client import StoreClient
from kvstore.service.client_types import Stats

log = logging.getLogger("vllm.kvstore.worker")


class WorkerCore:
    """Loads, saves and stages of one worker, each over a client of its own from
    `make_client(map_tier=...)`: only the loading client maps the service's DRAM tier.
    `fail_requests`: a failed load is reported by its request, not its blocks (LoadReports)."""

    def __init__(self, layout: KVLayout, rank: int, make_client: Callable[..., StoreClient],
                 staging: DeviceStagingPool | None = None,
                 save_window_wait_s: float = 2.0, fail_requests: bool = False) -> None:
        self.rank = rank
        self.stats = Stats()
        self.staging = staging
        self.reports = LoadReports(self.stats, fail_requests)
        self.loads = LoadHandler(layout, rank, partial(make_client, map_tier=True), self.stats, self.reports,
                                 staging)
        self.saves = SaveHandler(layout, rank, partial(make_client, map_tier=False), self.stats,
                                 save_window_wait_s)
        self.stages = (StageHandler(rank, partial(make_client, map_tier=False), self.stats, staging)
                       if staging is not None else None)
        # Engines do not always call shutdown before exiting; queued saves must still land.
        atexit.register(self.close)

    def start_loads(self, loads: Sequence[Transfer], step: int = 0) -> None:
        self.loads.start_loads(loads, step)

    def start_stages(self, stages: Sequence[Stage]) -> Future[None] | None:
        """Stage each request's chunks ahead of their load (None without a device pool)."""
        return self.stages.start_stages(stages) if self.stages is not None else None

    def save(self, saves: Sequence[Transfer]) -> None:
        self.saves.save(saves)

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """(requests whose async loads are done, those of them that failed: `fail_requests`)."""
        return self.reports.take_finished_loads()

    def take_failed_blocks(self) -> set[int]:
        return self.reports.take_failed_blocks()

    def take_done_saves(self) -> list[int]:
        return self.saves.take_done_saves()

    def take_loaded_steps(self) -> list[int]:
        return self.reports.take_loaded_steps()

    def take_counters(self) -> dict[str, int]:
        return self.reports.take_counters()

    def close(self) -> None:
        """Drain queued saves (bounded wait), then release every connection."""
        if not self.saves.close():
            return
        log.info("kvstore worker %d: %s", self.rank, self.stats.snapshot())
        self.loads.close()
        if self.stages is not None:
            self.stages.close()
