"""Shared fixtures: real O_DIRECT directories, both I/O engines, small chunk stores,
redis-servers. The helpers they call, and that tests import, live in tests/support."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from support.interrupt import tear_down_on_sigterm
from support.redis_servers import running
from support.stores import CHUNK_BYTES, direct_io_dir

from bench.support.engine_run import start_fork_server
from bench.support.redis_server import RedisClusterServers, RedisServer
from kvstore.io import make_engine
from kvstore.io.faulty import FaultyEngine
from kvstore.store.tiered import TieredStore

MICRO_JSON = Path(".benchmarks") / "micro.json"  # under the root dir; gitignored

# Time judges no test (benchmarks show speed): an example that takes long on a loaded machine
# is no failure, and neither is slow generation of its data.
settings.register_profile("kvstore", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvstore")


ENGINE_MARKS = ("slow", "vllm", "sglang")


def pytest_configure(config: pytest.Config) -> None:
    """A run stopped by SIGTERM (`timeout`, a cancelled job) still stops the servers its
    tests started (support/interrupt.py); in every xdist worker too, each loading this."""
    tear_down_on_sigterm()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Engine and other slow tests first, each file's in its order. The CI run spreads
    whole files over its workers in this order (`-n`, `--dist loadfile`): the long files
    started first leave the short ones to fill the end, not one long file running alone."""
    items.sort(key=lambda item: not any(item.get_closest_marker(mark) for mark in ENGINE_MARKS))


@pytest.fixture(scope="session")
def engine_fork_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One process per test worker that has imported vLLM, from which each fresh engine
    run is forked (bench/support/engine_fork.py): the same fresh engine, ~6 s sooner."""
    folder = tmp_path_factory.mktemp("engine-fork")
    with open(folder / "server.log", "wb") as log:
        server = start_fork_server(folder / "fork.sock", log)
    yield
    server.kill()
    server.wait()


@pytest.fixture(autouse=True)
def _engine_runs_fork(request: pytest.FixtureRequest) -> None:
    """Tests marked `vllm` run their engines through the worker's fork server."""
    if request.node.get_closest_marker("vllm"):
        request.getfixturevalue("engine_fork_server")


def pytest_collection_finish(session: pytest.Session) -> None:
    """When micro-benchmarks are about to run (tests/test_micro_bench.py, in the plain CI
    run too), their figures go to .benchmarks/micro.json unless --benchmark-json says
    where; a run without them writes nothing."""
    benchmarks = getattr(session.config, "_benchmarksession", None)
    if benchmarks is None or benchmarks.json or benchmarks.disabled or not any(
            "benchmark" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    benchmarks.json = session.config.rootpath / MICRO_JSON
    benchmarks.json.parent.mkdir(exist_ok=True)


@pytest.fixture
def disk_dir(tmp_path) -> str:
    """A directory on a filesystem that takes O_DIRECT (tmpfs does not)."""
    return direct_io_dir(tmp_path)


@pytest.fixture(params=["uring", "threads"])
def engine(request) -> str:
    return request.param


@pytest.fixture
def faulty(engine) -> Iterator[FaultyEngine]:
    """A real engine behind a fault injector; teardown frees anything left hanging."""
    wrapper = FaultyEngine(make_engine(engine, 8))
    yield wrapper
    wrapper.release()


@pytest.fixture
def store_factory() -> Iterator:
    """Opens stores and closes whatever a test left open."""
    opened: list[TieredStore] = []

    def open_store(config, chunk_bytes: int = CHUNK_BYTES, **kwargs) -> TieredStore:
        store = TieredStore(config, chunk_bytes, **kwargs)
        opened.append(store)
        return store

    yield open_store
    for store in opened:
        if store.probe.capacity("dram") or store.probe.capacity("disk"):  # not closed yet
            store.close()


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    with running(tmp_path, "redis", RedisServer, cluster=False) as server:
        yield server


@pytest.fixture
def redis_cluster(tmp_path) -> Iterator[RedisClusterServers]:
    """Six redis-server processes (3 masters, 3 replicas) made a cluster by `redis-cli
    --cluster create`; every one killed after the test."""
    with running(tmp_path, "redis-cluster", RedisClusterServers, cluster=True) as servers:
        yield servers
