"""The contract every engine backend keeps, written once: SGLang's HiCache backend
(tests/sglang_hicache_cases.py), LMCache's storage plugin (tests/lmcache_plugin_cases.py)
and LMCache MP's L2 adapter (tests/lmcache_mp_cases.py) each supply a driver and take
these cases by subclassing `Contract`:

    class TestContract(Contract):
        driver = "lmcache_plugin_cases:PluginDriver"

The cases, against one real kvstore service (a disk tier under a small DRAM tier):
round trip; a fresh process after a service restart loads from disk, and the one record
flipped on disk is a miss; memory of another size is a miss; planted records (bad
headers, for the backends that decode one) miss and touch nothing but their own
destination; a full engine pool misses within `io.timeout_s` + 5 s; a frozen (SIGSTOPped)
service makes every call a miss within the client's deadline (both time the backend's own
calls, less any stall of the machine itself: BackendCalls, support/stalls.py); and records
hypothesis makes up never raise, crash or leak.

Every case runs the backend in a Python process of its own (`run_case`): a SIGSEGV, an
abort or a hang fails that case with the child's output, and the child must exit 0.
Destinations are surrounded by guard memory the driver fills before a load and checks
after ("intact"), and the engine pool's active allocations, the process's descriptors
and threads are counted around the planted and fuzzed loads.

A driver (class `Driver` below says what it offers) names chunks by index: chunk i's
bytes and key are functions of i, the same in every process. The cases share one service
per backend (class-scoped), stored once; they tolerate running in any order or alone:
only chunk FLIPPED may be lost to the flipped-byte case, and nothing but the planted and
fuzzed records is written after the first store, each under a key of its own (the
service never overwrites a stored key: a record is planted only where none is yet).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

import pytest
from support.records import corrupt_record
from support.services import counters, service_client, small_service_config, stop_service
from support.stalls import StallMeter, stall_meter

from bench.support.processes import paused

ROOT = Path(__file__).resolve().parents[1]
COUNT = 5  # chunks stored (a driver may make the last one a prompt's shorter chunk)
FLIPPED = 1  # the chunk whose record the fresh-process case flips on disk
ROOM = 1  # chunks the full-pool case leaves room for in the engine's pool
TIMEOUT_S = 2.0  # the service's io.timeout_s; the client's request deadline is twice it
FULL_POOL_S = TIMEOUT_S + 5.0  # a load into a full pool returns within this
# Each call on a frozen service returns within this: one client deadline (4 s) and the 5 s
# this suite allows a loaded 2-core machine everywhere. Both timed cases subtract the time
# the machine stalled (support/stalls.py): a CI run once measured 9.1 s here, 6.1 s another
# (both before the driver's own work around a call was left out of its time: BackendCalls).
FROZEN_CALL_S = 2 * TIMEOUT_S + 5.0
FUZZ_EXAMPLES = 40
FUZZ_FIRST = 1000  # the first chunk index the fuzz case plants at (one per example)
SETTLE_AT = 900  # the chunk index a case plants at before it counts descriptors and threads
CHILD_TIMEOUT_S = 300
T = TypeVar("T")


class BackendCalls:
    """The calls a driver makes into its engine's backend, timed while a case measures
    them: a deadline judges the backend's calls, not the driver's own work around them
    (filling and checking guard memory, reading a pool back), which is no part of the
    backend and can take seconds on a loaded machine (a CI run measured 15 s around a
    frozen-service load whose backend call ends at its 4 s deadline)."""

    def __init__(self) -> None:
        self._meter: StallMeter | None = None
        self._seen: list[tuple[float, float]] = []  # (seconds, stalled) of each timed call

    def __call__(self, call: Callable[[], T]) -> T:
        """call() (the backend's), timed while a measure is under way."""
        if self._meter is None:
            return call()
        result, seconds, stalled = self._meter.timed(call)
        self._seen.append((seconds, stalled))
        return result

    def measure(self, meter: StallMeter, call: Callable[[], T]) -> tuple[T, dict[str, float]]:
        """call()'s result and its times: in all, of the backend calls it made, and the
        stalls of the machine during those (the meter's)."""
        self._meter, self._seen = meter, []
        try:
            result, seconds, _ = meter.timed(call)
        finally:
            self._meter = None
        return result, {"seconds": seconds, "calls": len(self._seen),
                        "backend": sum(s for s, _ in self._seen), "stalled": sum(st for _, st in self._seen)}


class Driver(Protocol):
    """One engine backend, opened on the service a store config names, as its engine
    would open it (in the child process)."""

    headers: bool  # its records carry a header it decodes: a planted one must miss
    allocates: bool  # it allocates the engine's memory for what it loads (LMCache's plugin)
    payload_at: int  # where a record's bytes the engine sees begin (after its header)
    store: dict[str, Any]  # the config it was opened with
    calls: BackendCalls  # wraps each call it makes into the backend (load, exists, save)

    def __init__(self, store: dict[str, Any]) -> None: ...

    def key(self, i: int) -> bytes:
        """The kvstore key chunk i is stored under."""

    def expected(self, i: int) -> bytes:
        """Chunk i's bytes as the engine holds them."""

    def save(self, indices: Sequence[int]) -> list[bool]: ...

    def exists(self, indices: Sequence[int]) -> int:
        """The leading run of chunks stored."""

    def load(self, indices: Sequence[int], room: int | None = None) -> tuple[list[bytes | None], bool]:
        """Each chunk's bytes (None: a miss), loaded into destinations surrounded by guard
        memory; and whether the guard is intact. `room`: the engine's pool is full but for
        that many chunks (a backend that allocates nothing loads into memory the engine
        handed it before)."""

    def wrong_size(self, indices: Sequence[int]) -> tuple[list[bytes | None], bool]:
        """load, into memory of another size than was stored."""

    def bad_records(self) -> dict[str, bytes]:
        """Whole records (one chunk's bytes each) a hostile client could store: labelled."""

    def fuzz_records(self) -> Any:
        """A hypothesis strategy of whole records."""

    def plant(self, i: int, record: bytes) -> bool:
        """Store `record` as it is under chunk i's key, as any client of the service may."""

    def allocations(self) -> int:
        """The engine pool's active allocations (0 for a backend that allocates none)."""

    def close(self) -> None: ...


def driver_of(spec: str) -> type[Driver]:
    module, _, name = spec.partition(":")
    driver: type[Driver] = getattr(importlib.import_module(module), name)
    return driver


# -- the child's side: one case, one process ------------------------------------------


def _process_state() -> tuple[int, list[str]]:
    """Open descriptors and the names of live threads (a leak's message says whose)."""
    return len(os.listdir("/proc/self/fd")), sorted(thread.name for thread in threading.enumerate())


def _verdicts(loaded: Sequence[bytes | None], wanted: Sequence[bytes]) -> list[str]:
    return ["miss" if got is None else "equal" if got == want else "other"
            for got, want in zip(loaded, wanted, strict=True)]


def _within(got: bytes, record: bytes, driver: Driver) -> bool:
    return got == record[driver.payload_at : driver.payload_at + len(got)]


def _store(driver: Driver, out: Path) -> dict[str, Any]:
    indices = range(COUNT)
    saved = driver.save(indices)
    found = driver.exists(indices)
    loaded, intact = driver.load(indices)
    return {"saved": saved, "exists": found, "intact": intact, "flipped_key": driver.key(FLIPPED).hex(),
            "loaded": _verdicts(loaded, [driver.expected(i) for i in indices])}


def _load(driver: Driver, out: Path) -> dict[str, Any]:
    loaded, intact = driver.load(range(COUNT))
    return {"loaded": _verdicts(loaded, [driver.expected(i) for i in range(COUNT)]), "intact": intact,
            "exists": driver.exists(range(COUNT))}


def _wrong_size(driver: Driver, out: Path) -> dict[str, Any]:
    loaded, intact = driver.wrong_size(range(COUNT))
    return {"loaded": _verdicts(loaded, [driver.expected(i) for i in range(COUNT)]), "intact": intact}


def _settle(driver: Driver) -> None:
    """Threads, connections and learnt shapes settle before a case counts them: a load of
    what is stored, and a planted record's write and load (a writer's threads start on its
    first write)."""
    driver.load(range(COUNT))
    driver.plant(SETTLE_AT, next(iter(driver.bad_records().values())))
    driver.load([SETTLE_AT])


def _planted(driver: Driver, out: Path) -> dict[str, Any]:
    _settle(driver)
    before, allocations = _process_state(), driver.allocations()
    records = driver.bad_records()
    at = {label: COUNT + j for j, label in enumerate(records)}
    planted = {label: driver.plant(at[label], record) for label, record in records.items()}
    loaded, intact = driver.load(list(at.values()))
    verdicts = {label: "miss" if got is None else "planted" if _within(got, records[label], driver)
                else "other" for label, got in zip(records, loaded, strict=True)}
    return {"planted": planted, "loaded": verdicts, "intact": intact,
            "allocations": [allocations, driver.allocations()], "process": [before, _process_state()]}


def _full_pool(driver: Driver, out: Path) -> dict[str, Any]:
    allocations = driver.allocations()
    with stall_meter(out.parent) as meter:
        (loaded, intact), times = driver.calls.measure(meter, lambda: driver.load(range(COUNT), room=ROOM))
    return {**times, "intact": intact,
            "loaded": _verdicts(loaded, [driver.expected(i) for i in range(COUNT)]),
            "allocations": [allocations, driver.allocations()]}


def _frozen(driver: Driver, out: Path) -> dict[str, Any]:
    """The service stopped (SIGSTOP) under an engine that was using it: every call a miss
    within the deadline. Its pid goes to OUT.pid first, so the parent resumes it whatever
    happens here."""
    driver.load(range(COUNT))  # connected, answered, and the load path warm: the calls
    # timed below time the backend, not a first use of the engine's memory
    client = service_client(driver.store)
    try:
        pid = int(client.info()["service_pid"])
    finally:
        client.close()
    out.with_suffix(".pid").write_text(str(pid))
    calls: dict[str, Callable[[], Any]] = {
        "load": lambda: driver.load(range(COUNT))[0], "exists": lambda: driver.exists(range(COUNT)),
        "save": lambda: driver.save(range(100, 100 + COUNT))}
    seen = {}
    with stall_meter(out.parent) as meter, paused(pid):
        for name, call in calls.items():
            answer, times = driver.calls.measure(meter, call)
            seen[name] = {**times, "answer": answer}
    return seen


def _fuzz(driver: Driver, out: Path) -> dict[str, Any]:
    """Records hypothesis makes up, each planted and loaded: never an exception, a guard
    touched or an allocation kept; a hit only with the record's own bytes."""
    from hypothesis import HealthCheck, given, settings

    _settle(driver)
    before, allocations = _process_state(), driver.allocations()
    seen = {"examples": 0, "hits": 0}

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(driver.fuzz_records())
    def one(record: bytes) -> None:
        at = FUZZ_FIRST + seen["examples"]  # a key of its own: a stored key is never overwritten
        seen["examples"] += 1
        assert driver.plant(at, record)
        (got,), intact = driver.load([at])
        assert intact, "a load wrote outside its destination"
        assert got is None or _within(got, record, driver), "a hit that is not the record's bytes"
        assert driver.allocations() == allocations, "an allocation outlived the load"
        seen["hits"] += got is not None

    one()
    return {**seen, "process": [before, _process_state()]}


CASES: dict[str, Callable[[Driver, Path], dict[str, Any]]] = {
    "store": _store, "load": _load, "wrong_size": _wrong_size, "planted": _planted,
    "full_pool": _full_pool, "frozen": _frozen, "fuzz": _fuzz}


def main(argv: Sequence[str]) -> None:
    """In the child: DRIVER CASE STORE_JSON OUT."""
    spec, case, raw, out = argv
    driver = driver_of(spec)(json.loads(raw))
    try:
        answer = CASES[case](driver, Path(out))
    finally:
        driver.close()
    Path(out).write_text(json.dumps(answer))


# -- the parent's side ------------------------------------------------------------------


def run_case(spec: str, case: str, store: dict[str, Any], where: Path) -> dict[str, Any]:
    """`case` in a Python process of its own (this interpreter, the checkout and tests/ on
    its path): its answer; a crash, a hang or a non-zero exit fails the test."""
    out = where / f"{case}-{time.monotonic_ns()}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"),
                                                                      os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-c", "import sys, backend_contract; backend_contract.main(sys.argv[1:])",
               spec, case, json.dumps(store), str(out)]
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{case}: the backend's process hung past {CHILD_TIMEOUT_S} s:\n"
                    f"{str(exc.stdout or '')[-3000:]}{str(exc.stderr or '')[-3000:]}")
    finally:
        _resume(out)
    if done.returncode:
        how = (f"killed by {signal.Signals(-done.returncode).name}" if done.returncode < 0
               else f"exit {done.returncode}")
        pytest.fail(f"{case}: the backend's process ended with {how}:\n{(done.stdout + done.stderr)[-6000:]}")
    answer: dict[str, Any] = json.loads(out.read_text())
    return answer


def _resume(out: Path) -> None:
    """A frozen case's service, resumed even where the child died before it could."""
    pid = out.with_suffix(".pid")
    if pid.exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid.read_text()), signal.SIGCONT)


class Contract:
    """The cases, for the driver a subclass names ("module:Class")."""

    driver: ClassVar[str]

    @pytest.fixture(scope="class")
    def stored(self, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], dict, Path]]:
        """A service of its own (its disk tier on a filesystem that takes O_DIRECT) with
        COUNT chunks stored through the backend: (its config, the store case's answer,
        a directory for the cases' files)."""
        where = tmp_path_factory.mktemp("contract")
        probe = where / "probe"
        try:
            os.close(os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT))
        except OSError:
            pytest.skip("the temporary directory's filesystem does not support O_DIRECT")
        probe.unlink()
        store = small_service_config(where, str(where))
        store["io"]["timeout_s"] = TIMEOUT_S
        try:
            yield store, run_case(self.driver, "store", store, where), where
        finally:
            stop_service(store)

    def test_round_trip(self, stored):
        _, answer, _ = stored
        assert answer["saved"] == [True] * COUNT and answer["exists"] == COUNT, answer
        assert answer["loaded"] == ["equal"] * COUNT and answer["intact"], answer

    def test_a_fresh_process_after_a_restart_loads_from_disk_and_a_flipped_byte_is_a_miss(self, stored):
        store, _, where = stored
        stop_service(store)  # the DRAM tier goes: what comes back is read from disk and verified
        corrupt_record(store["tiers"]["disk"][0]["path"], key=bytes.fromhex(stored[1]["flipped_key"]))
        answer = run_case(self.driver, "load", store, where)
        assert answer["loaded"] == ["miss" if i == FLIPPED else "equal" for i in range(COUNT)], answer
        assert answer["intact"] and answer["exists"] == FLIPPED, answer  # the flipped record is gone
        assert counters(store)["disk.miss.bad_checksum"] == 1

    def test_memory_of_another_size_is_a_miss(self, stored):
        store, _, where = stored
        answer = run_case(self.driver, "wrong_size", store, where)
        assert answer["loaded"] == ["miss"] * COUNT and answer["intact"], answer

    def test_planted_records_touch_nothing_but_their_own_destination(self, stored):
        store, _, where = stored
        answer = run_case(self.driver, "planted", store, where)
        assert all(answer["planted"].values()), answer["planted"]
        allowed = {"miss"} if driver_of(self.driver).headers else {"miss", "planted"}
        wrong = {label: v for label, v in answer["loaded"].items() if v not in allowed}
        assert wrong == {}, f"planted records that did not miss: {wrong}"
        assert answer["intact"], "a planted record was written outside its destination"
        before, after = answer["allocations"]
        assert after == before, f"allocations outlived the load: {before} -> {after}"
        assert answer["process"][0] == answer["process"][1], f"(fds, threads) leaked: {answer['process']}"
        if driver_of(self.driver).headers:
            assert counters(store).get("load.bad_header", 0) >= len(answer["loaded"]), counters(store)

    def test_a_full_engine_pool_misses_within_the_deadline(self, stored):
        store, _, where = stored
        answer = run_case(self.driver, "full_pool", store, where)
        assert answer["calls"] >= 1 and answer["intact"], answer
        assert answer["backend"] - answer["stalled"] <= FULL_POOL_S, answer
        loaded = answer["loaded"]
        if driver_of(self.driver).allocates:  # room for ROOM chunks: the rest are misses
            assert loaded == ["equal"] * ROOM + ["miss"] * (COUNT - ROOM), answer
        else:  # it loads into memory the engine handed it
            assert [v for i, v in enumerate(loaded) if i != FLIPPED] == ["equal"] * (COUNT - 1), answer
        assert answer["allocations"][0] == answer["allocations"][1], answer

    def test_a_frozen_service_is_a_miss_within_the_deadline(self, stored):
        store, _, where = stored
        answer = run_case(self.driver, "frozen", store, where)
        within = {name: call["calls"] >= 1 and call["backend"] - call["stalled"] <= FROZEN_CALL_S
                  for name, call in answer.items()}
        assert within == {"load": True, "exists": True, "save": True}, answer
        assert answer["load"]["answer"] == [None] * COUNT and answer["exists"]["answer"] == 0, answer
        assert answer["save"]["answer"] == [False] * COUNT, answer

    def test_made_up_records_never_raise_crash_or_leak(self, stored):
        store, _, where = stored
        answer = run_case(self.driver, "fuzz", store, where)
        assert answer["examples"] >= FUZZ_EXAMPLES // 2, answer
        assert answer["process"][0] == answer["process"][1], f"(fds, threads) leaked: {answer['process']}"
