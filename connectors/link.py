"""A service client that survives the service: re-created, rate-limited, after a failure,
without ever holding the caller past a request deadline."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait

from connectors.worker_threads import unbind
from kvstore.format.errors import KVStoreError
from kvstore.service.client import ServiceUnavailable, StoreClient

log = logging.getLogger("vllm.kvstore")
RECONNECT_INTERVAL_S = 5.0
FIRST_WAIT_S = 1.0  # how long a caller waits for a reconnect before any client told its deadline


class ServiceLink:
    """`get()` returns a connected client, or None while the service is unavailable
    (then at most one reconnect attempt every RECONNECT_INTERVAL_S).

    Invariants: a reconnect runs on a thread of its own, and `get()` waits for it no
    longer than the last client's request deadline (its `timeout_s`). Connecting may
    take far longer than one request: a hung service answers no hello (whose allowance
    is long, for the store the first one makes), a dead one is spawned again. A
    reconnect that outlasts the wait is taken by a later `get()`, or closed if the link
    closed meanwhile. At most one reconnect is in flight."""

    def __init__(self, make: Callable[[], StoreClient]) -> None:
        self._make = make
        self._client: StoreClient | None = None
        self._next_try = 0.0
        self._wait_s = FIRST_WAIT_S
        self._reconnect: Future[StoreClient] | None = None
        self._lock = threading.Lock()  # get() may be called from several threads
        self._closed = False

    def start(self) -> None:
        """Connect at start-up, on the caller's thread. A bad config or a service that
        cannot start is an error now; a service that does not answer only costs misses
        until it does."""
        try:
            self._adopt(self._make())
        except ServiceUnavailable as exc:
            log.warning("kvstore service unavailable at start-up (%s); serving without it "
                        "until it answers", exc)
            self._next_try = time.monotonic() + RECONNECT_INTERVAL_S

    def get(self) -> StoreClient | None:
        """The connected client; else, when a reconnect is due, one made within the wait
        (None while the service is unavailable or the reconnect is still under way)."""
        if self._client is not None:
            return self._client
        with self._lock:
            if self._closed or self._client is not None:
                return self._client
            if self._reconnect is None:
                if time.monotonic() < self._next_try:
                    return None
                self._reconnect = _in_thread(self._make)
            pending = self._reconnect
        wait([pending], timeout=self._wait_s)  # outside the lock: each caller waits once
        with self._lock:
            if pending is self._reconnect and pending.done():
                self._reconnect = None
                try:
                    self._adopt(pending.result())
                except Exception as exc:  # any fault of a reconnect (launcher, hello): wait, try again
                    log.warning("kvstore service unavailable (%s); loads miss and saves drop", exc,
                                exc_info=not isinstance(exc, (KVStoreError, OSError)))
                    self._next_try = time.monotonic() + RECONNECT_INTERVAL_S
            return self._client

    def peek(self) -> StoreClient | None:
        """The connected client, or None; never connects (for a thread that must not
        wait on a service: the engine's, between forward passes)."""
        return self._client

    def fail(self) -> None:
        """Forget a client whose service stopped answering. Only its connection is
        closed: another thread may still be copying through its window, which is
        unmapped when the last reference goes."""
        if self._client is not None:
            self._client.disconnect()
            self._client = None
            self._next_try = time.monotonic() + RECONNECT_INTERVAL_S

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._reconnect is not None:  # closes what it makes, whenever it does
                self._reconnect.add_done_callback(_close_made)
                self._reconnect = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def _adopt(self, client: StoreClient) -> None:
        self._client, self._wait_s = client, client.timeout_s


def _in_thread(make: Callable[[], StoreClient]) -> Future[StoreClient]:
    """`make()` on a daemon thread (one stuck in a spawn or a hello never holds up exit),
    unbound from an engine's compute core: a service it spawns inherits its CPUs."""
    made: Future[StoreClient] = Future()

    def run() -> None:
        unbind()
        try:
            made.set_result(make())
        except BaseException as exc:  # handed to whoever takes the result
            made.set_exception(exc)

    threading.Thread(target=run, name="kvstore-reconnect", daemon=True).start()
    return made


def _close_made(made: Future[StoreClient]) -> None:
    if made.exception() is None:
        made.result().close()
