"""redis-server for the cluster tests: one instance, or a Redis Cluster of three masters
with a replica each (bench/support/redis_server.py starts them); the fixtures
(`redis_server`, `redis_cluster`) are tests/conftest.py's.

scripts/setup.sh installs Debian's redis-server with apt where it is missing; where it
is not installed the tests that need it skip, saying so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.support.redis_server import redis_server_unavailable


@contextlib.contextmanager
def running(tmp_path: Path, name: str, servers: Any, cluster: bool) -> Iterator[Any]:
    """`servers` (made on a fresh directory `tmp_path/name`) started, and stopped after;
    the test skips where redis-server (or the redis client) is missing."""
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
