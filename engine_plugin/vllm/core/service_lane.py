"""Calls to the service on a thread and a connection of their own, for code that must
never wait on the service (an engine's scheduler thread).

A lane runs its calls in order; each is `call(client)` on its link's client, and a
failure (the service unavailable, a request that failed) is None, logged, never an
exception: the engine's thread must not see it. A lane with a bound (`most`) is for best
effort work (counters, request ends, touches, event polls): past `most` calls waiting, a
new one is dropped at once (None, counted in `dropped`), so a slow service costs that
work, never a backlog that grows with it, delays the calls behind it past their
deadlines, or holds the engine's shutdown; closing such a lane drops what still waits.
The secondary tier keeps its lookups on a lane of their own (tier_lookups.py), so they
never queue behind best effort work.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from connectors.link import ServiceLink
from connectors.worker_threads import pool
from kvstore.format.errors import KVStoreError
from kvstore.service.client import StoreClient

log = logging.getLogger("kvstore.tier")
T = TypeVar("T")


def _answered(value: T | None) -> Future[T | None]:
    done: Future[T | None] = Future()
    done.set_result(value)
    return done


class ServiceLane:
    """`submit(call)`: `call(client)` on the lane's thread and connection, its result or None."""

    def __init__(self, link: ServiceLink, name: str, most: int | None = None) -> None:
        self.link = link
        self.most = most
        self.dropped = 0  # calls refused because `most` were waiting
        self._thread = pool(name)
        self._lock = threading.Lock()
        self._waiting = 0

    def submit(self, call: Callable[[StoreClient], T]) -> Future[T | None]:
        with self._lock:
            if self.most is not None and self._waiting >= self.most:
                self.dropped += 1
                return _answered(None)
            self._waiting += 1

        def run() -> T | None:
            with self._lock:
                self._waiting -= 1
            client = self.link.get()
            if client is None:
                return None
            try:
                return call(client)
            except KVStoreError as exc:
                log.warning("kvstore tier: a request to the service failed (%s); a miss", exc)
                self.link.fail()
            except Exception:  # whatever it was, the engine's scheduler must not see it
                log.exception("kvstore tier: a request to the service failed; a miss")
            return None

        try:
            return self._thread.submit(run)
        except RuntimeError:  # closed
            with self._lock:
                self._waiting -= 1
            return _answered(None)

    def take_dropped(self) -> int:
        with self._lock:
            dropped, self.dropped = self.dropped, 0
        return dropped

    def close(self) -> None:
        """Stop the thread once the call it runs ends (within the service's deadline); a
        bounded lane drops the calls still waiting, an unbounded one runs them first (each
        within its deadline; after a failure the rest find the service unavailable at
        once). Then the link."""
        self._thread.shutdown(wait=True, cancel_futures=self.most is not None)
        self.link.close()
