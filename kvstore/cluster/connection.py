"""The index's connection: one Redis (or Valkey) instance, or a Redis Cluster; no retries.

`redis://`, `rediss://`, `unix://` name one instance (redis-py's client).
`redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]` (`rediss+cluster://`: TLS)
names a Redis Cluster (redis-py's cluster client): the nodes listed are where it first
reads the slot map; it follows MOVED and ASK and reads the map again after a node fails.
A URL's user and password authenticate every connection (Redis's AUTH, an ACL user or
`requirepass`); a `rediss` URL's connections are TLS, checked against `cluster.index_tls`'s
CA (else the system's), with its client certificate where the index asks for one.
Neither client retries (redis-py's would, which multiplies a deadline): a failure is the
caller's to count.

A single instance's batch is one pipeline sent from a worker thread and waited for
until the deadline, as a shard's is (below): a reconnect resolves the host's name, which
no socket timeout bounds. On a cluster every shard's part of a batch is its own pipeline,
sent from a worker thread of its own and waited for until one deadline: a shard that
does not answer (its master died, or hangs, and no replica has taken over yet) costs
only its own commands, within that deadline, however long redis-py's pipeline then
spends retrying them one by one.
Such a shard is skipped for `backoff_s` (and while a part sent to it is still overdue);
the others are not. The cluster client (its first slot map) is built in the background:
a caller waits for it at most its deadline, so nodes that accept and never answer
cannot hold a host's start or its lookups.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from kvstore.config.store import CLUSTER_SCHEMES, IndexTlsConfig, cluster_nodes

FAILURES = (redis.RedisError, RedisClusterException, OSError)  # what a dead or slow index raises
NODE_DOWN = (redis.ConnectionError, redis.TimeoutError, OSError)  # a shard's node, not a command, failed
MALFORMED = redis.ResponseError  # a command refused (a key of the wrong type): that entry, not the index
Command = tuple[str, tuple[Any, ...]]  # a pipeline method's name and its arguments; args[0] names the key(s)
INSTANCE = "instance"  # the one "shard" of a single instance


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


class _Workers:
    """Daemon threads that send shards' parts. A thread is added whenever none is idle (a
    part stuck on a hung node holds its thread), so no part waits for another's."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads = 0

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1  # that one takes it
            else:
                self._threads += 1
                threading.Thread(target=self._work, name="kvstore-index-shard", daemon=True).start()
        self._jobs.put(job)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()
            with self._lock:
                self._idle += 1

    def close(self) -> None:
        with self._lock:
            for _ in range(self._threads):
                self._jobs.put(None)
            self._threads = self._idle = 0


class _Part:
    """One shard's commands in flight on a thread of their own."""

    def __init__(self, node: str, indices: list[int]) -> None:
        self.node = node
        self.indices = indices
        self.answers: list[Any] = []
        self.done = threading.Event()
        self.overdue = False  # its caller stopped waiting; it still holds its shard


class IndexConnection:
    """A client for `url` whose every batch answers within its deadline or fails: on a
    cluster, shard by shard."""

    def __init__(self, url: str, timeout_s: float, backoff_s: float = 0.0,
                 tls: IndexTlsConfig | None = None) -> None:
        """`timeout_s`: each socket operation's, and a batch's deadline; `backoff_s`: how
        long a cluster shard that failed is not asked again; `tls`: a rediss URL's files."""
        self.url = url
        self.cluster = url.startswith(CLUSTER_SCHEMES)
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self._options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
                                         "retry": Retry(NoBackoff(), 0), **(tls.options() if tls else {})}
        self._client: Any = None if self.cluster else redis.Redis.from_url(
            url, health_check_interval=0, **self._options)
        self._lock = threading.Lock()
        self._building: threading.Thread | None = None
        self._build_error: BaseException | None = None
        self._built = threading.Event()
        self._skip_until: dict[str, float] = {}  # node name -> when it may be asked again
        self._overdue: dict[str, int] = {}  # node name -> its parts still running past their deadline
        self._workers = _Workers()
        self._closed = False

    @property
    def client(self) -> Any:
        """redis.Redis, or RedisCluster once its slot map was read (else a FAILURE: the
        build goes on in the background, the caller waits at most `timeout_s`)."""
        if self._client is not None:
            return self._client
        with self._lock:
            if self._closed:
                raise redis.ConnectionError("the index connection is closed")
            if self._building is None and self._client is None:
                self._built.clear()
                self._building = threading.Thread(target=self._build, name="kvstore-index-connect",
                                                  daemon=True)
                self._building.start()
        self._built.wait(self.timeout_s)
        with self._lock:
            if self._client is not None:
                return self._client
            if self._build_error is not None:
                error, self._build_error = self._build_error, None
                raise error
        raise redis.TimeoutError(f"the Redis Cluster's slot map was not read within {self.timeout_s:g} s")

    def _build(self) -> None:
        nodes = [ClusterNode(host, port) for host, port in cluster_nodes(self.url)]
        client: Any = None
        error: BaseException | None = None
        try:
            client = RedisCluster(startup_nodes=nodes, ssl=self.url.startswith("rediss"),
                                  require_full_coverage=False, **_credentials(self.url), **self._options)
        except Exception as exc:  # FAILURES, or anything else: the next caller builds again
            error = exc
        with self._lock:
            self._building = None
            if client is not None and self._closed:
                client.close()
            elif client is not None:
                self._client = client
            else:
                self._build_error = error
            self._built.set()

    def run(self, commands: Sequence[Command]) -> list[Any]:
        """The commands' results, within `timeout_s`; a command Redis refused (MALFORMED)
        gives its exception as its result. One instance: one pipeline, whose failure (or
        lateness) raises. A cluster: one pipeline per shard; a shard that fails, is late or
        is backing off gives its commands' exceptions as their results. Either way each
        pipeline is sent from a worker thread: what no socket timeout bounds (resolving the
        host's name at a reconnect) holds that thread, never the caller."""
        client = self.client
        started = time.monotonic()
        results: list[Any] = [None] * len(commands)
        shards: dict[str, list[int]] = {}
        if not self.cluster:
            shards[INSTANCE] = list(range(len(commands)))
        for i, (_, args) in enumerate(commands if self.cluster else ()):
            key = args[0] if isinstance(args[0], bytes | str) else args[0][0]
            try:
                shards.setdefault(client.get_node_from_key(key).name, []).append(i)
            except FAILURES as exc:  # no shard serves its slot now
                results[i] = exc
        parts = []
        for node, indices in shards.items():
            refused = self._refused(node, started)
            if refused is not None:
                for i in indices:
                    results[i] = refused
                continue
            part = _Part(node, indices)
            self._workers.submit(functools.partial(self._send, client, commands, part))
            parts.append(part)
        until = started + self.timeout_s
        for part in parts:
            part.done.wait(max(0.0, until - time.monotonic()))
            answers = self._collect(part)
            for i, answer in zip(part.indices, answers, strict=True):
                results[i] = answer
        if not self.cluster:  # the instance failed, not one command
            failed = [a for a in results if isinstance(a, BaseException) and not isinstance(a, MALFORMED)]
            if failed:
                raise failed[0]
        return results

    def _refused(self, node: str, now: float) -> BaseException | None:
        with self._lock:
            if self._overdue.get(node):
                return redis.TimeoutError(f"shard {node} still owes an earlier answer")
            if self._skip_until.get(node, 0.0) > now:
                return redis.ConnectionError(f"shard {node} failed; not asked for {self.backoff_s:g} s")
        return None

    def _send(self, client: Any, commands: Sequence[Command], part: _Part) -> None:
        try:
            pipe = client.pipeline(transaction=False)
            for i in part.indices:
                _queue(pipe, *commands[i])
            answers = list(pipe.execute(raise_on_error=False))
        except Exception as exc:  # FAILURES, or redis-py's own errors when closed under a late part:
            answers = [exc] * len(part.indices)  # either way the part ends and its shard is freed
        with self._lock:
            part.answers = answers
            part.done.set()
            if part.overdue:
                self._overdue[part.node] -= 1

    def _collect(self, part: _Part) -> list[Any]:
        """The part's answers, or a timeout for each if it is late (it then holds its shard).
        A cluster's shard that failed is skipped for `backoff_s`; a single instance is the
        caller's to skip (cluster/node.py's lookups skip the index, its awaiting does not)."""
        with self._lock:
            backoff = time.monotonic() + self.backoff_s if self.cluster else 0.0
            if not part.done.is_set():
                part.overdue = True
                self._overdue[part.node] = self._overdue.get(part.node, 0) + 1
                self._skip_until[part.node] = backoff
                late = redis.TimeoutError(f"shard {part.node} did not answer within {self.timeout_s:g} s")
                return [late] * len(part.indices)
            if any(isinstance(answer, NODE_DOWN) for answer in part.answers):
                self._skip_until[part.node] = backoff
            return part.answers

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._client is not None:
                self._client.close()
        self._workers.close()
