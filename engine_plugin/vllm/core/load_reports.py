"""What a worker's loads have to tell: the engine (async loads finished or failed, blocks
that did not load) and the scheduler (the plans whose sync loads ran, what the leased
copies moved and took).

Loads run on the forward pass's thread (sync) or the load pool's (async); the engine and
the scheduler take the reports between steps. Invariants: an async load's request is
reported finished once, after the last of its transfers (a hybrid model's groups load in
transfers of their own), and, with `fail_requests`, failed in that same take if one of
them failed, never after its finish; every other failure is reported by its blocks; each
report is taken once.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Collection, Mapping

from kvstore.service.client_types import Stats


class LoadReports:
    def __init__(self, stats: Stats, fail_requests: bool = False) -> None:
        self.stats = stats
        self.fail_requests = fail_requests
        self._lock = threading.Lock()
        self._finished_loads: set[str] = set()  # async loads done, not yet taken
        self._failed_loads: set[str] = set()  # of those, the ones of which a transfer failed
        self._loads_left: Counter[str] = Counter()  # a request's loads still running (one per group)
        self._failing: set[str] = set()  # requests still loading, of which one transfer failed
        self._failed_blocks: set[int] = set()
        self._loaded_steps: list[int] = []  # plans whose sync loads ran, not yet taken
        self._unreported: Counter[str] = Counter()  # for the service, by way of the scheduler

    def started(self, req_ids: Collection[str]) -> None:
        """Transfers of these requests begin (a request once per transfer)."""
        with self._lock:
            self._loads_left.update(req_ids)

    def step_loaded(self, step: int) -> None:
        """Plan `step`'s sync loads ran: the scheduler's leases for them may go."""
        with self._lock:
            self._loaded_steps.append(step)

    def ended(self, req_id: str, failed: Collection[int], report_finished: bool, given_up: bool) -> None:
        """A transfer of `req_id` ended, `failed` the blocks it did not load; an async one
        (`report_finished`) reports its request once its last transfer has ended; `given_up`:
        the scheduler had dropped its keys (with `fail_requests` that fails the request)."""
        per_request = self.fail_requests and report_finished
        with self._lock:
            if failed:
                self.stats.add("load.failed_blocks", len(failed))
                if not per_request:
                    self._failed_blocks.update(failed)
            if per_request and (failed or given_up):  # a given-up load fails, blocks or none
                self._failing.add(req_id)
            self._loads_left[req_id] -= 1
            if self._loads_left[req_id] <= 0:
                del self._loads_left[req_id]
                if report_finished:
                    self._finished_loads.add(req_id)
                    if req_id in self._failing:
                        self._failed_loads.add(req_id)
                self._failing.discard(req_id)

    def copied(self, counters: Mapping[str, int]) -> None:
        """What a leased copy moved and took, for the worker's log and the service."""
        for name, amount in counters.items():
            self.stats.add(name, amount)
        with self._lock:
            self._unreported.update(counters)

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
