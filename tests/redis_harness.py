"""The redis-server fixture of the cluster tests (bench/redis_server.py starts it).

scripts/setup.sh installs Debian's redis-server with apt where it is missing; where it
is not installed the tests that need it skip, saying so.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.redis_server import RedisServer, redis_server_unavailable


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    reason = redis_server_unavailable()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("redis", reason="the redis client is not installed (pip install -e .)")
    workdir = tmp_path / "redis"
    workdir.mkdir()
    server = RedisServer(workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()
