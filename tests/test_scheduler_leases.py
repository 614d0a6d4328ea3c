"""A stateful property test of the scheduler side's DRAM leases (engine_plugin/vllm/core/leases.py),
driven through SchedulerCore's hooks in the orders vLLM calls them: requests arrive and are
asked, asked again, allocated (with the hit or nothing to load), faulted, preempted and
finished, between steps whose plans the workers carry out and report (loads failed by
request or by block). Every lease a lookup gave is released exactly once, never while a
planned load may still copy from it, read exactly when a load copied from it and did not
fail, and every one is released once the requests are gone and their loads reported."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine_plugin.vllm.core.groups import KVGeometry
from engine_plugin.vllm.core.prefetch import Residency
from engine_plugin.vllm.core.scheduler_side import SchedulerCore, SchedulerSettings
from kvstore.format.keys import KVNamespace, Shard, TensorParallel

CHUNK, BLOCK = 256, 128
CHUNKS = 8
PROMPT = list(range(CHUNKS * CHUNK + 5))  # a load may cover all 8 full chunks
NAMESPACES = tuple(KVNamespace("m", "float16", "cpu", CHUNK, Shard(TensorParallel(rank, 2)))
                   for rank in (0, 1))
def blocks_of(req_id: str) -> list[int]:
    """A request's blocks (two per chunk); no two requests share one, as in vLLM."""
    first = int(req_id[1:]) * 2 * CHUNKS
    return list(range(first, first + 2 * CHUNKS))


COMPUTED = st.sampled_from([0, CHUNK, 3 * CHUNK + BLOCK, CHUNKS * CHUNK])  # the engine's own hit


class SchedulerLeases(RuleBasedStateMachine):
    @initialize(load_async=st.booleans(), sync_dram_loads=st.booleans(), resident=st.integers(0, CHUNKS))
    def start(self, load_async: bool, sync_dram_loads: bool, resident: int) -> None:
        self.resident = resident  # leading chunks in DRAM, what a lookup leases
        self.given: list[int] = []  # every lease a lookup gave
        self.released: list[int] = []  # every lease the core gave back
        self.unread: set[int] = set()  # of those, the ones given back unread (no gets)
        self.read: set[int] = set()  # ... and read (their chunks counted as gets)
        self.planned: set[int] = set()  # leases a planned load copies from
        self.failed: set[int] = set()  # of those, the ones whose load the workers reported failed
        self.last_lease = 0  # the lease the latest lookup gave (0: none)
        self.lease_of: dict[str, int] = {}  # each request's latest decision's lease
        self.waiting: dict[str, int] = {}  # asked, not allocated: request -> its answer
        self.running: set[str] = set()  # allocated, its load (if any) over
        self.loading: set[str] = set()  # its async load (given up or not) is not reported yet
        self.gone: set[str] = set()  # finished or abandoned
        # Leases loads the workers may still copy from: lease -> (request, the plan that
        # shipped it if a sync load, else None). A request preempted while its sync load's
        # plan is unreported may have a second load by then (vLLM's async scheduling).
        self.reading: dict[int, tuple[str, int | None]] = {}
        self.unreported: dict[int, set[int]] = {0: set(), 1: set()}  # plans each rank has not reported
        self.next_id = 0
        self.core = SchedulerCore(KVGeometry(CHUNK, BLOCK), lambda salt: NAMESPACES, self.lookup,
                                  SchedulerSettings(load_async=load_async, sync_dram_loads=sync_dram_loads))

    def lookup(self, keys: list[list[bytes]], prefetch: bool, lease_from: int | None = None) -> Residency:
        self.last_lease = 0
        if lease_from is None or lease_from >= self.resident:
            return Residency(len(keys[0]), self.resident)
        self.last_lease = len(self.given) + 1
        self.given.append(self.last_lease)
        offsets = tuple(i * 4096 if lease_from <= i < self.resident else -1 for i in range(len(keys[0])))
        return Residency(len(keys[0]), self.resident, lease=self.last_lease, offsets=(offsets, offsets))

    def ask(self, req_id: str, computed: int) -> None:
        answer = self.core.num_new_matched_tokens(req_id, PROMPT, computed)
        assert answer is not None  # nothing here holds a request
        self.waiting[req_id] = answer
        self.lease_of[req_id] = self.last_lease

    def forget(self, req_id: str) -> None:
        self.waiting.pop(req_id, None)
        self.running.discard(req_id)
        self.gone.add(req_id)

    def collect(self) -> None:
        """Take the leases the core gave back (as its next request to the service would)."""
        released = self.core.take_releases()
        self.released += released.read + released.unread
        self.unread.update(released.unread)
        self.read.update(released.read)

    # -- rules ------------------------------------------------------------------------

    @rule(resident=st.integers(0, CHUNKS))
    def dram_turns_over(self, resident: int) -> None:
        self.resident = resident

    @rule(computed=COMPUTED)
    def arrive(self, computed: int) -> None:
        self.next_id += 1  # vLLM's request ids are unique
        self.ask(f"r{self.next_id}", computed)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def schedule(self, data: st.DataObject) -> None:
        """One schedule() call: some waiting requests asked again (no room yet), some given
        blocks (with the hit, or nothing to load), one of them perhaps faulting in a later
        hook; then the step's plan."""
        for req_id in sorted(self.waiting):
            what = data.draw(st.sampled_from(["wait", "ask again", "load", "load nothing", "fault"]))
            if what == "ask again":
                self.ask(req_id, data.draw(COMPUTED))
            elif what != "wait":
                answer = self.waiting.pop(req_id)
                self.core.on_alloc(req_id, blocks_of(req_id), 0 if what == "load nothing" else answer)
                self.running.add(req_id)
                if what == "fault":
                    self.core.abandon(req_id)
                    self.forget(req_id)
        plan = self.core.take_plan()
        self.collect()
        if any(not load.load_async for load in plan.loads):  # each rank reports it once it ran them
            for steps in self.unreported.values():
                steps.add(plan.step)
        for load in plan.loads:
            if load.load_async:  # reported ended, given up or not
                self.running.discard(load.req_id)
                self.loading.add(load.req_id)
            if not load.keys:  # given up: nothing is copied
                continue
            if any(offset >= 0 for rank in load.leased for offset in rank):
                lease = self.lease_of[load.req_id]
                assert lease and lease not in self.released, f"{load.req_id}'s load reads a released lease"
                self.reading[lease] = (load.req_id, None if load.load_async else plan.step)
                self.planned.add(lease)

    @rule(data=st.data(), by_block=st.booleans())
    def report(self, data: st.DataObject, by_block: bool) -> None:
        """The workers report a step (vLLM's aggregate of both ranks): the async loads that
        ended on every rank, the plans whose sync loads each rank ran (a report may come
        after the next plan shipped), and failed loads: by request (an async load, as it
        ends) or by a block it writes (any load still copying, its request gone or not)."""
        ended = data.draw(st.sets(st.sampled_from(sorted(self.loading)))) if self.loading else set()
        steps = {rank: data.draw(st.sets(st.sampled_from(sorted(left)))) if left else set()
                 for rank, left in self.unreported.items()}
        for rank, reported in steps.items():
            self.unreported[rank] -= reported
        ran = [step for reported in steps.values() for step in reported]
        if by_block:  # a block of a load that copies in this report: async, or of a plan reported
            copying = sorted(lease for lease, (_, step) in self.reading.items()
                             if step is None or any(step in reported for reported in steps.values()))
            chosen = data.draw(st.sets(st.sampled_from(copying))) if copying else set()
            failed = {self.reading[lease][0] for lease in chosen}
            blocks = [blocks_of(req_id)[-1] for req_id in failed]  # the last: written by any load
            self.core.step_done(sorted(ended), failed_blocks=blocks, steps=ran)
            self.failed.update(lease for lease in copying if self.reading[lease][0] in failed)
        else:
            failed = data.draw(st.sets(st.sampled_from(sorted(ended)))) if ended else set()
            self.core.step_done(sorted(ended), sorted(failed), steps=ran)
            self.failed.update(lease for lease, (req_id, step) in self.reading.items()
                               if req_id in failed and step is None)
        self.loading -= ended
        for lease, (req_id, step) in list(self.reading.items()):
            done = (req_id in ended if step is None
                    else all(step not in left for left in self.unreported.values()))  # every rank ran it
            if done:
                del self.reading[lease]

    @precondition(lambda self: self.running)
    @rule(data=st.data(), computed=COMPUTED)
    def preempt(self, data: st.DataObject, computed: int) -> None:
        """A running request loses its blocks and is asked again (vLLM's preemption), its
        sync load's plan perhaps not reported yet (async scheduling)."""
        req_id = data.draw(st.sampled_from(sorted(self.running)))
        self.running.discard(req_id)
        self.ask(req_id, computed)

    @precondition(lambda self: {*self.waiting, *self.running, *self.loading} - self.gone)
    @rule(data=st.data(), fault=st.booleans())
    def finish(self, data: st.DataObject, fault: bool) -> None:
        """A request finishes or is aborted (its load may be under way), or a fault abandons it."""
        req_id = data.draw(st.sampled_from(sorted({*self.waiting, *self.running, *self.loading} - self.gone)))
        (self.core.abandon if fault else self.core.on_finished)(req_id)
        self.forget(req_id)

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def each_lease_is_released_once_and_never_while_a_load_reads_it(self) -> None:
        if not hasattr(self, "core"):
            return
        self.collect()
        assert len(set(self.released)) == len(self.released), f"released twice: {self.released}"
        assert set(self.released) <= set(self.given)
        early = set(self.reading) & set(self.released)
        assert not early, f"released while a load copies from it: {early}"
        copied = self.planned - self.failed  # leases a load copied from, and did not fail
        assert not self.unread & copied, "a lease a load copied from was given back as unread"
        assert self.read <= copied, "a lease no load copied from (or whose load failed) was read"

    def teardown(self) -> None:
        if not hasattr(self, "core"):
            return
        for req_id in sorted({*self.waiting, *self.running, *self.loading} - self.gone):
            self.core.on_finished(req_id)
        plan = self.core.take_plan()
        steps = [*self.unreported[0], *self.unreported[1], *([plan.step] * 2)]
        self.core.step_done(sorted(self.loading), steps=steps)  # the loads under way end, the plans ran
        self.collect()
        assert sorted(self.released) == self.given, "a lease was never released"


TestSchedulerLeases = SchedulerLeases.TestCase
TestSchedulerLeases.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
