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
from dataclasses import dataclass
from typing import NamedTuple


class Released(NamedTuple):
    """Leases done with, as the next request to the service gives them back."""

    read: list[int]  # each one's load was carried out: its chunks count as gets
    unread: list[int]  # no load was: no get


@dataclass
class _Load:
    """A planned load that copies from a lease, until every worker is done with it."""

    req_id: str
    blocks: frozenset[int]  # the blocks it writes (a failed one fails the load)
    sync: bool  # copied before the forward pass of the step that ships it, else while the request waits
    step: int | None = None  # the plan that shipped it (None: not shipped yet)
    reports: int = 0  # workers that reported that plan's sync loads carried out
    failed: bool = False  # given up after a fault, or reported failed (by request or block)


class Leases:
    """Every lease the scheduler's lookups took, until it is told to the service as done with.

    Invariants:
    - A request holds at most one lease not yet planned from (`hold`: its latest lookup's).
      One it no longer needs, because it loads nothing or it is looked up again, is
      released at once (`drop`); one whose load is planned (`planned`) becomes that load's.
    - A load's lease is released only once no worker can still copy from it, whatever
      became of its request meanwhile (finished, aborted, preempted and asked again): an
      async load's when the workers report that load ended, finished or failed (vLLM
      reports it once every worker has); a sync load's once every worker (`workers`) has
      reported the plan that shipped it (`shipped`) carried out. Under vLLM's async
      scheduling the next plan is taken before a step is reported, so a report names
      the plans it covers (`step_done`), never "the last one".
    - A released lease is told to the service once, with its next request (`take`: a
      lookup carries them); a lookup that decides nothing (`release`) gives its lease
      back the same way.
    - A lease released once its load was carried out (shipped, then ended: not given up
      after a fault, not reported failed by request or by one of the blocks it writes)
      is `read`; any other is `unread` (the request loaded nothing, was asked again,
      held, or forgotten first, or its load was given up or failed). The service counts
      a leased chunk as a get only when read, so a request asked again while it waits
      for blocks is not a hit at every step.
    """

    def __init__(self, workers: int = 1) -> None:
        self._workers = workers  # whose reports this scheduler hears (SchedulerSettings.reporting_workers)
        self._held: dict[str, int] = {}  # each request's lease, no load planned from it yet
        self._loads: dict[int, _Load] = {}  # each lease a planned load copies from
        self._read: list[int] = []  # done with after its load, told to the service on its next request
        self._unread: list[int] = []  # done with, no load carried out from them

    def hold(self, req_id: str, lease: int) -> None:
        """The lookup that decided `req_id`'s load took `lease` (0: none)."""
        if lease:
            self._held[req_id] = lease

    def drop(self, req_id: str) -> None:
        """`req_id`'s held lease is not needed (it loads nothing, is asked again, or is
        forgotten): released now. A load planned from an earlier one keeps its own until
        the workers are done with it (`step_done`)."""
        self.release(self._held.pop(req_id, 0))

    def planned(self, req_id: str, blocks: Iterable[int], sync: bool) -> None:
        """A load of `req_id` writing `blocks` is planned (`sync`: in its step): its held
        lease is that load's, until the workers are done with it."""
        lease = self._held.pop(req_id, 0)
        if lease:
            self._loads[lease] = _Load(req_id, frozenset(blocks), sync)

    def given_up(self, req_id: str) -> None:
        """After a fault, `req_id`'s load not yet shipped was given up: it copies nothing
        (its lease still goes back only once the workers report it, as any load's)."""
        for load in self._loads.values():
            if load.req_id == req_id and load.step is None:
                load.failed = True

    def shipped(self, step: int) -> None:
        """Plan `step` ships to the workers with every load planned since the last one (a
        sync one copies before its forward pass; a given-up one copies nothing)."""
        for load in self._loads.values():
            if load.step is None:
                load.step = step

    def step_done(self, loads_ended: Iterable[str], failed: Iterable[str] = (),
                  failed_blocks: Iterable[int] = (), steps: Iterable[int] = ()) -> None:
        """The workers reported: async loads that ended (finished or failed), loads that
        failed by request or by a block they write, and the plans whose sync loads a worker
        carried out (a step once per worker). A load whose every worker is done releases
        its lease: read, but for a failed one."""
        ended, failed, bad = set(loads_ended), set(failed), set(failed_blocks)
        reports: dict[int, int] = {}
        for step in steps:
            reports[step] = reports.get(step, 0) + 1
        for lease, load in list(self._loads.items()):
            if load.step is None:
                continue  # not shipped: no worker has it
            ran = reports.get(load.step, 0) if load.sync else 0
            # A sync load's failed blocks come in the report of the plan it ran in: a block
            # failed in another plan's load is not its own (freed by a preemption since).
            mine = not bad.isdisjoint(load.blocks) and (ran > 0 or not load.sync)
            load.failed = load.failed or load.req_id in failed or mine
            load.reports += ran
            if load.reports >= self._workers if load.sync else load.req_id in ended | failed:
                del self._loads[lease]
                (self._unread if load.failed else self._read).append(lease)

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
