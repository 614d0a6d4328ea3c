"""The index's connection: one Redis (or Valkey) instance, or a Redis Cluster; no retries.

`redis://`, `rediss://`, `unix://` name one instance (redis-py's client).
`redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]` (`rediss+cluster://`: TLS)
names a Redis Cluster (redis-py's cluster client): the nodes listed are where it first
reads the slot map; it follows MOVED and ASK and reads the map again after a node fails.
Neither client retries (redis-py's would, which multiplies a deadline): a failure is the
caller's to count. The cluster client is made on first use, so a host starts while the
cluster is unreachable, as it does with one instance down.

A cluster pipeline goes to every shard at once. When a shard does not answer (its master
died and no replica has taken over yet), `run` sends each shard's part on its own, so
only the commands routed to the dead shard fail.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from kvstore.config.store import CLUSTER_SCHEMES, cluster_nodes

FAILURES = (redis.RedisError, RedisClusterException, OSError)  # what a dead or slow index raises
Command = tuple[str, tuple[Any, ...]]  # a pipeline method's name and its arguments; args[0] names the key(s)


def shown(url: str) -> str:
    """The index URL with its password hidden, for logs and `kvstore info`."""
    return re.sub(r"(//[^/@:]*:)[^@/]*@", r"\1***@", url)


def _credentials(url: str) -> dict[str, Any]:
    userinfo, at, _ = urlsplit(url).netloc.rpartition("@")
    if not at:
        return {}
    user, _, password = userinfo.partition(":")
    return {"username": unquote(user) or None, "password": unquote(password) or None}


def _queue(pipe: Any, name: str, args: tuple[Any, ...]) -> None:
    if name == "mget":  # the cluster pipeline has no MGET method, but sends one whose keys share a slot
        pipe.execute_command("MGET", *args[0])
    else:
        getattr(pipe, name)(*args)


class IndexConnection:
    """A client for `url` whose every command answers within `timeout_s` or fails."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self.cluster = url.startswith(CLUSTER_SCHEMES)
        self._options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
                                         "retry": Retry(NoBackoff(), 0)}
        self._client: Any = None if self.cluster else redis.Redis.from_url(
            url, health_check_interval=0, **self._options)
        self._lock = threading.Lock()  # one cluster client, however many threads ask first

    @property
    def client(self) -> Any:
        """redis.Redis, or RedisCluster once the slot map could be read (else a FAILURE)."""
        with self._lock:
            if self._client is None:
                nodes = [ClusterNode(host, port) for host, port in cluster_nodes(self.url)]
                self._client = RedisCluster(startup_nodes=nodes, ssl=self.url.startswith("rediss"),
                                            require_full_coverage=False, **_credentials(self.url),
                                            **self._options)
            return self._client

    def pipeline(self) -> Any:
        return self.client.pipeline(transaction=False)

    def run(self, commands: Sequence[Command]) -> list[Any]:
        """The commands' results in one pipeline (per shard). One instance: a failure raises.
        A cluster: a shard that fails gives its commands' exceptions as their results."""
        pipe = self.pipeline()
        for name, args in commands:
            _queue(pipe, name, args)
        if not self.cluster:
            return list(pipe.execute())
        try:
            return list(pipe.execute(raise_on_error=False))
        except FAILURES:  # a shard did not answer: send each shard's part alone
            return self._by_shard(commands)

    def _by_shard(self, commands: Sequence[Command]) -> list[Any]:
        shards: dict[str, list[int]] = {}
        results: list[Any] = [None] * len(commands)
        for i, (_, args) in enumerate(commands):
            key = args[0] if isinstance(args[0], bytes | str) else args[0][0]
            try:
                shards.setdefault(self.client.get_node_from_key(key).name, []).append(i)
            except FAILURES as exc:  # no shard serves its slot now
                results[i] = exc
        for indices in shards.values():
            pipe = self.pipeline()
            for i in indices:
                _queue(pipe, *commands[i])
            try:
                answers = pipe.execute(raise_on_error=False)
            except FAILURES as exc:
                answers = [exc] * len(indices)
            for i, answer in zip(indices, answers, strict=True):
                results[i] = answer
        return results

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
