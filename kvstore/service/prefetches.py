"""The service's promotions to DRAM: what engines' lookups and next-turn predictions ask
to have in DRAM before a request runs, done one at a time, the users who asked in turn.

One at a time: each promotion's wave bounds the bytes in flight, and a get for the same
chunks never waits on it (it reads them itself). In turn: each user's runs wait in a queue
of its own (a next-turn prediction's in the queue of the user it predicts for), at most QUEUED_MOST of
them (past that a run is not promoted, counted as `prefetch.dropped`), and the one thread
takes a run from each user in turn, so a co-tenant asking for many runs delays the owner's
next promotion by one run at most, never by its whole backlog. A residency answer is one
snapshot: the chunks found, those in DRAM and whether a promotion of that run is queued are
read while no promotion can finish. Invariants: a run is queued at most once; a run leaves
the queue when its promotion ends, however it ends; after `close` nothing more is promoted.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence

from kvstore.store.tiered import TieredStore

log = logging.getLogger(__name__)
QUEUED_MOST = 1024  # runs one user may have waiting for a promotion


class Prefetches:
    def __init__(self) -> None:
        self._lock = threading.Condition()  # held across a residency snapshot
        self._queued: set[tuple[bytes, ...]] = set()  # runs waiting or running
        self._waiting: OrderedDict[int, deque[tuple[TieredStore, tuple[bytes, ...]]]] = OrderedDict()
        self._closed = False
        self._last: int | None = None  # the user whose run was taken last: the others go first
        self._thread = threading.Thread(target=self._run, name="kvstore-prefetch", daemon=True)
        self._thread.start()

    def residency(self, store: TieredStore, ranks: Sequence[Sequence[bytes]], prefetch: bool,
                  await_s: float = 0.0, uid: int | None = None) -> list[object]:
        """[leading chunks every rank has, of those in DRAM on every rank, a promotion of
        some rank's run queued or running]; with `prefetch`, each rank's run is queued first
        (in the queue of `uid`, the asking client's user); with `await_s`, what each rank
        lacks is awaited at the peers for `uid` (TieredStore.lookup)."""
        with self._lock:
            found = [store.lookup(list(keys), await_s, uid) for keys in ranks]
            runs = [tuple(keys[: f.count]) for keys, f in zip(ranks, found, strict=True)]
            if prefetch:
                for run in runs:
                    self._queue(store, run, os.geteuid() if uid is None else uid)
            pending = any(run in self._queued for run in runs)
        return [min(f.count for f in found), min(f.resident for f in found), pending]

    def promote(self, store: TieredStore, keys: tuple[bytes, ...], uid: int | None = None) -> None:
        """A chain a next-turn prediction wants in DRAM now, in the turn of `uid`, the user
        whose request or hint predicted it (None: the service's own)."""
        with self._lock:
            self._queue(store, keys, os.geteuid() if uid is None else uid)

    def _queue(self, store: TieredStore, run: tuple[bytes, ...], uid: int) -> None:
        """Queue a promotion of `run` for `uid` unless the same run is queued (a request
        waiting to be scheduled, or a hint, asks for the same chunks again) or `uid` has
        QUEUED_MOST waiting (lock held)."""
        if not run or run in self._queued or self._closed:
            return
        waiting = self._waiting.setdefault(uid, deque())
        if len(waiting) >= QUEUED_MOST:
            store.stats.add("prefetch.dropped")
            return
        waiting.append((store, run))
        self._queued.add(run)
        self._lock.notify()

    def _run(self) -> None:
        """Promote one run at a time, taking the next user's after each."""
        while True:
            with self._lock:
                while not self._closed and not any(self._waiting.values()):
                    self._lock.wait()
                if self._closed:
                    return
                users = [uid for uid, waiting in self._waiting.items() if waiting]
                uid = next((other for other in users if other != self._last), users[0])  # turns
                waiting = self._waiting.pop(uid)
                store, run = waiting.popleft()
                if waiting:
                    self._waiting[uid] = waiting  # behind every other user's
                self._last = uid
            try:
                store.prefetch(run)
            except Exception:
                log.exception("prefetch of %d chunks failed", len(run))
            finally:
                with self._lock:
                    self._queued.discard(run)

    def close(self) -> None:
        """Queued promotions dropped, the running one finished."""
        with self._lock:
            self._closed = True
            self._waiting.clear()
            self._lock.notify()
        self._thread.join()
