"""The redis-server fixtures of the cluster tests: one instance, or a Redis Cluster of
three masters with a replica each (bench/support/redis_server.py starts them).

scripts/setup.sh installs Debian's redis-server with apt where it is missing; where it
is not installed the tests that need it skip, saying so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.support.redis_server import RedisClusterServers, RedisServer, redis_server_unavailable


@contextlib.contextmanager
def _running(tmp_path: Path, name: str, servers: Any, cluster: bool) -> Iterator[Any]:
    """`servers` (made on a fresh directory `tmp_path/name`) started, and stopped after."""
    reason = redis_server_unavailable(cluster)
    if reason:
        pytest.skip(reason)
    pytest.importorskip("redis", reason="the redis client is not installed (pip install -e .)")
    workdir = tmp_path / name
    workdir.mkdir()
    started = servers(workdir)
    started.start()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    with _running(tmp_path, "redis", RedisServer, cluster=False) as server:
        yield server


@pytest.fixture
def redis_cluster(tmp_path) -> Iterator[RedisClusterServers]:
    """Six redis-server processes (3 masters, 3 replicas) made a cluster by `redis-cli
    --cluster create`; every one killed after the test."""
    with _running(tmp_path, "redis-cluster", RedisClusterServers, cluster=True) as servers:
        yield servers
