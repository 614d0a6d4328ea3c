"""The DRAM leases that protect decided loads, from the lookup that takes one to its release.

As in vLLM's own offloading, the scheduler decides and protects once; the workers only
copy. The lookup that decides a load (a model with one KV cache group) leases the run the
store holds in DRAM from the first chunk the engine's own prefix cache lacks, so nothing
of it is evicted between the decision and the workers' copy, and the plan carries each
rank's offsets for the workers to copy from the shared tier with no request of their own.
A lease pins DRAM the service needs for others, so it goes back as soon as no copy can
still read it; a lease is never given back while one can.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class Released(NamedTuple):
    """Leases done with, as the next request to the service gives them back."""

    read: list[int]  # each one's load was carried out: its chunks count as gets
    unread: list[int]  # no load was: no get


class Leases:
    """Every lease the scheduler's lookups took, until it is told to the service as done with.

    Invariants:
    - A request holds at most one lease (`hold`: its latest lookup's). One it no longer
      needs, because it loads nothing or it is looked up again, is released at once (`drop`).
    - A lease is released only once no worker can still copy from it: an async load's
      (`loading`) when the workers report that load ended, finished or failed
      (`step_done`); a sync load's after the step whose forward pass its copy precedes
      (`after_step`, then `step_done`); a forgotten request's (`forget`) at once, unless
      its async load is under way, then when that load ends.
    - A released lease is told to the service once, with its next request (`take`: a
      lookup carries them); a lookup that decides nothing (`release`) gives its lease
      back the same way.
    - A lease released once its load was carried out (planned, then ended: not given up
      after a fault, not reported failed) is `read`; any other is `unread` (the request
      loaded nothing, was asked again, held, forgotten first, or its load was given up or
      failed). The service counts a leased chunk as a get only when read, so a request
      asked again while it waits for blocks is not a hit at every step. (A model with one
      KV cache group has a failed load reported by block: SchedulerCore names the request
      that holds the block.)
    """

    def __init__(self) -> None:
        self._held: dict[str, int] = {}  # each request's lease, by request
        self._loading: set[str] = set()  # requests whose async load is under way
        # Forgotten requests' leases until their async load ends, and whether that load was
        # given up (a fault) before it ran.
        self._orphans: dict[str, tuple[int, bool]] = {}
        self._after_step: list[tuple[str, int]] = []  # this step's sync loads' leases: released after it
        self._read: list[int] = []  # done with after its load, told to the service on its next request
        self._unread: list[int] = []  # done with, no load carried out from them

    def hold(self, req_id: str, lease: int) -> None:
        """The lookup that decided `req_id`'s load took `lease` (0: none)."""
        if lease:
            self._held[req_id] = lease

    def drop(self, req_id: str) -> None:
        """`req_id`'s lease is not needed (it loads nothing, or it is asked again): released now."""
        self._loading.discard(req_id)
        self.release(self._held.pop(req_id, 0))

    def loading(self, req_id: str) -> None:
        """An async load of `req_id` is planned: its lease stays until the workers report it ended."""
        self._loading.add(req_id)

    def after_step(self, req_ids: Iterable[str]) -> None:
        """Sync loads of these requests are in this step's plan: their workers copy before the
        forward pass, so their leases go once the step is reported."""
        for req_id in req_ids:
            lease = self._held.pop(req_id, 0)
            if lease:
                self._after_step.append((req_id, lease))

    def step_done(self, loads_ended: Iterable[str], failed: Iterable[str] = ()) -> None:
        """The workers reported a step: its sync loads' leases go, and those of the async
        loads that ended in it; read, but for the loads reported `failed` (by request)."""
        failed = set(failed)
        for req_id, lease in self._after_step:
            (self._unread if req_id in failed else self._read).append(lease)
        self._after_step = []
        for req_id in [*loads_ended, *failed]:
            lease, given_up = self._orphans.pop(req_id, (0, False))
            if req_id in self._loading:
                self._loading.discard(req_id)
                lease = self._held.pop(req_id, 0)
            if lease:
                (self._unread if given_up or req_id in failed else self._read).append(lease)

    def forget(self, req_id: str, given_up: bool = False) -> None:
        """`req_id` is forgotten: its lease goes now, or once its async load ends (`step_done`);
        `given_up`: after a fault, its load (if any) was given up and copies nothing."""
        lease = self._held.pop(req_id, 0)
        if req_id in self._loading:
            self._loading.discard(req_id)
            if lease:
                self._orphans[req_id] = (lease, given_up)
        else:
            self.release(lease)

    def release(self, lease: int) -> None:
        """`lease` (0: none) is done with, no load carried out from it: told to the service
        on its next request."""
        if lease:
            self._unread.append(lease)

    def take(self) -> Released:
        """The leases to tell the service are done with (on the next request to it)."""
        released = Released(self._read, self._unread)
        self._read, self._unread = [], []
        return released
