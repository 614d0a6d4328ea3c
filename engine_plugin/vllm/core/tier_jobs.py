"""A secondary tier's transfers: stores and loads between an engine's host memory and the
service, run as jobs off the engine's thread, and collected by it when they end.

An engine's tiering layer (vLLM's, engine_plugin/vllm/tier.py) hands a secondary tier a
job (an id, chunk keys, where in host memory each chunk is) and must not wait for it:
the job runs on a thread of its own, loads on their threads and stores on another so a
load never waits behind a store, each thread over its own service connection
(connectors/page_io.py: the one data plane SGLang's and LMCache's backends use). Loads
run on as many threads as they are given connections: while the service reads one job's
chunks, another job's are copied. A store is one or more chains, each
stored under the parent it names. Every job ends in `finished` exactly once, with each
chunk's fate: a chunk that missed, did not verify or ran past the service's deadline is
False there, never an exception. `drain` waits until no job touches host memory.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from connectors.page_io import PageIO, Segments
from connectors.worker_threads import pool, unbind

log = logging.getLogger("kvstore.tier")


@dataclass(frozen=True)
class Chain:
    """Chunks stored as one chain: keys[0] under `parent`, each next under the one before;
    their records name `namespace` (None: the connection's)."""

    keys: Sequence[bytes]
    pages: Sequence[Segments]
    parent: bytes | None = None
    namespace: bytes | None = None


@dataclass(frozen=True)
class JobDone:
    job_id: int
    done: list[bool]  # each chunk's fate, in the order the job gave them
    seconds: float


class TierJobs:
    def __init__(self, reads: Sequence[PageIO], writes: PageIO) -> None:
        self.reads, self.writes = list(reads), writes
        self._idle: queue.SimpleQueue[PageIO] = queue.SimpleQueue()  # a load takes one, gives it back
        for io in self.reads:
            self._idle.put(io)
        self._loads = ThreadPoolExecutor(len(self.reads), "kvstore-tier-load", initializer=unbind)
        self._stores = pool("kvstore-tier-store")
        self._finished: queue.SimpleQueue[JobDone] = queue.SimpleQueue()
        self._running: dict[int, Future[None]] = {}
        self._lock = threading.Lock()

    def load(self, job_id: int, keys: Sequence[bytes], pages: Sequence[Segments]) -> None:
        """Fill pages[i] with chunk keys[i]."""

        def run() -> list[bool]:
            io = self._idle.get()  # one is free: there are as many threads as connections
            try:
                return io.load(keys, pages)
            finally:
                self._idle.put(io)

        self._submit(self._loads, job_id, len(keys), run)

    def store(self, job_id: int, chains: Sequence[Chain]) -> None:
        """Store each chain (the job's chunks are the chains' in order)."""

        def run() -> list[bool]:
            return [ok for chain in chains
                    for ok in self.writes.save(chain.keys, chain.pages, chain.parent, chain.namespace)]

        self._submit(self._stores, job_id, sum(len(chain.keys) for chain in chains), run)

    def _submit(self, pool: ThreadPoolExecutor, job_id: int, count: int,
                work: Callable[[], list[bool]]) -> None:
        def run() -> None:
            started = time.monotonic()
            try:
                done = list(work())
            except Exception:  # a bad page or a bug: the job's chunks miss, its thread lives on
                log.exception("kvstore tier job %d failed; its %d chunks miss", job_id, count)
                done = [False] * count
            with self._lock:
                self._running.pop(job_id, None)
            self._finished.put(JobDone(job_id, done, time.monotonic() - started))

        with self._lock:
            try:
                self._running[job_id] = pool.submit(run)
            except RuntimeError:  # closed: the job ends at once, every chunk missed
                self._finished.put(JobDone(job_id, [False] * count, 0.0))

    def finished(self) -> list[JobDone]:
        """The jobs that ended since the last call."""
        ended = []
        while True:
            try:
                ended.append(self._finished.get_nowait())
            except queue.Empty:
                return ended

    def pending(self) -> bool:
        with self._lock:
            return bool(self._running)

    def drain(self) -> None:
        """Wait until every job submitted so far has ended (each within the service's
        deadlines); their results stay for `finished`."""
        with self._lock:
            running = list(self._running.values())
        wait(running)

    def close(self) -> None:
        """Let running jobs end, then close the connections."""
        self._loads.shutdown(wait=True)
        self._stores.shutdown(wait=True)
        for io in [*self.reads, self.writes]:
            io.close()
