"""`threads` engine: os.preadv/os.pwritev in bounded thread pools, one per file.

Works everywhere (containers often forbid io_uring). The syscalls release the
GIL, so `queue_depth` threads keep that many requests at the device. One pool per
file descriptor: a device whose requests never return (a lost NVMe-oF path) ties
up its own threads, at most `queue_depth` of them, never another device's.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from collections.abc import Sequence

from kvstore.io.base import TIMED_OUT, IoEngine, IoRequest, OnComplete


def _execute(request: IoRequest) -> int:
    try:
        if request.write:
            return os.pwritev(request.fd, request.buffers, request.offset)
        return os.preadv(request.fd, request.buffers, request.offset)
    except OSError as exc:
        return -(exc.errno or 5)


class ThreadsEngine(IoEngine):
    name = "threads"

    def __init__(self, queue_depth: int) -> None:
        super().__init__(queue_depth)
        self._pools: dict[int, cf.ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    def _pool(self, fd: int) -> cf.ThreadPoolExecutor:
        with self._lock:
            pool = self._pools.get(fd)
            if pool is None:
                pool = cf.ThreadPoolExecutor(max_workers=self.queue_depth,
                                             thread_name_prefix=f"kvstore-io-fd{fd}")
                self._pools[fd] = pool
            return pool

    def run(
        self,
        requests: Sequence[IoRequest],
        timeout_s: float | None = None,
        on_complete: OnComplete | None = None,
    ) -> list[int]:
        results = [TIMED_OUT] * len(requests)
        futures = {self._pool(r.fd).submit(_execute, r): i for i, r in enumerate(requests)}
        try:
            for future in cf.as_completed(futures, timeout=timeout_s):
                index = futures[future]
                results[index] = future.result()
                if on_complete is not None:
                    on_complete(index, results[index])
        except TimeoutError:
            pass  # the stragglers keep TIMED_OUT
        return results

    def close(self) -> None:
        # Do not wait: a thread stuck in uninterruptible sleep must not hang close().
        with self._lock:
            for pool in self._pools.values():
                pool.shutdown(wait=False, cancel_futures=True)
            self._pools.clear()
