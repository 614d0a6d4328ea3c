"""The redis-server fixtures of the cluster tests: one instance, or a Redis Cluster of
three masters with a replica each (bench/redis_server.py starts them).

scripts/setup.sh installs Debian's redis-server with apt where it is missing; where it
is not installed the tests that need it skip, saying so.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.redis_server import RedisClusterServers, RedisServer, redis_server_unavailable


def _require_redis(cluster: bool = False) -> None:
    reason = redis_server_unavailable(cluster)
    if reason:
        pytest.skip(reason)
    pytest.importorskip("redis", reason="the redis client is not installed (pip install -e .)")


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    _require_redis()
    workdir = tmp_path / "redis"
    workdir.mkdir()
    server = RedisServer(workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_cluster(tmp_path) -> Iterator[RedisClusterServers]:
    """Six redis-server processes (3 masters, 3 replicas) made a cluster by `redis-cli
    --cluster create`; every one killed after the test."""
    _require_redis(cluster=True)
    workdir = tmp_path / "redis-cluster"
    workdir.mkdir()
    servers = RedisClusterServers(workdir)
    servers.start()
    try:
        yield servers
    finally:
        servers.stop()
