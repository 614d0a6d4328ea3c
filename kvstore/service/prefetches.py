"""The service's promotions to DRAM: what engines' lookups and next-turn predictions ask
to have in DRAM before a request runs, done one at a time in the order asked.

One at a time: each promotion's wave bounds the bytes in flight, and a get for the same
chunks never waits on it (it reads them itself). A residency answer is one snapshot: the
chunks found, those in DRAM and whether a promotion of that run is queued are read while
no promotion can finish. Invariants: a run is queued at most once; a run leaves the queue
when its promotion ends, however it ends; after `close` nothing more is promoted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvstore.store.tiered import TieredStore

log = logging.getLogger(__name__)


class Prefetches:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, "kvstore-prefetch")
        self._lock = threading.Lock()  # held across a residency snapshot
        self._queued: set[tuple[bytes, ...]] = set()  # runs waiting for the pool or running

    def residency(self, store: TieredStore, ranks: Sequence[Sequence[bytes]], prefetch: bool,
                  await_s: float = 0.0) -> list[object]:
        """[leading chunks every rank has, of those in DRAM on every rank, a promotion of
        some rank's run queued or running]; with `prefetch`, each rank's run is queued first;
        with `await_s`, what each rank lacks is awaited at the peers (TieredStore.lookup)."""
        with self._lock:
            found = [store.lookup(list(keys), await_s) for keys in ranks]
            runs = [tuple(keys[: f.count]) for keys, f in zip(ranks, found, strict=True)]
            if prefetch:
                for run in runs:
                    self._queue(store, run)
            pending = any(run in self._queued for run in runs)
        return [min(f.count for f in found), min(f.resident for f in found), pending]

    def promote(self, store: TieredStore, keys: tuple[bytes, ...]) -> None:
        """A chain a next-turn prediction wants in DRAM now."""
        with self._lock:
            self._queue(store, keys)

    def _queue(self, store: TieredStore, run: tuple[bytes, ...]) -> None:
        """Queue a promotion of `run` unless the same run is queued: a request waiting to be
        scheduled, or a hint, asks for the same chunks again (lock held)."""
        if not run or run in self._queued:
            return
        self._queued.add(run)

        def promote() -> None:
            try:
                store.prefetch(run)
            except Exception:
                log.exception("prefetch of %d chunks failed", len(run))
            finally:
                with self._lock:
                    self._queued.discard(run)

        try:
            self._pool.submit(promote)
        except RuntimeError:  # shutting down
            self._queued.discard(run)

    def close(self) -> None:
        """Queued promotions dropped, the running one finished."""
        self._pool.shutdown(wait=True, cancel_futures=True)
