"""A service client that survives the service: re-created, rate-limited, after a failure."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvstore.format.errors import KVStoreError
from kvstore.service.client import ServiceUnavailable, StoreClient

log = logging.getLogger("vllm.kvstore")
RECONNECT_INTERVAL_S = 5.0


class ServiceLink:
    """`get()` returns a connected client, or None while the service is unavailable
    (then at most one reconnect attempt every RECONNECT_INTERVAL_S)."""

    def __init__(self, make: Callable[[], StoreClient]) -> None:
        self._make = make
        self._client: StoreClient | None = None
        self._next_try = 0.0

    def start(self) -> None:
        """Connect at start-up. A bad config or a service that cannot start is an
        error now; a service that does not answer only costs misses until it does."""
        try:
            self._client = self._make()
        except ServiceUnavailable as exc:
            log.warning("kvstore service unavailable at start-up (%s); serving without it "
                        "until it answers", exc)
            self._next_try = time.monotonic() + RECONNECT_INTERVAL_S

    def get(self) -> StoreClient | None:
        if self._client is None and time.monotonic() >= self._next_try:
            try:
                self._client = self._make()
            except KVStoreError as exc:
                log.warning("kvstore service unavailable (%s); loads miss and saves drop", exc)
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
        if self._client is not None:
            self._client.close()
            self._client = None
