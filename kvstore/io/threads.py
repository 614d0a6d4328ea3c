"""`threads` engine: os.preadv/os.pwritev in a bounded thread pool.

Works everywhere (containers often forbid io_uring). The syscalls release the
GIL, so `queue_depth` threads keep that many requests at the device.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
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
        self._pool = cf.ThreadPoolExecutor(max_workers=queue_depth, thread_name_prefix="kvstore-io")

    def run(
        self,
        requests: Sequence[IoRequest],
        timeout_s: float | None = None,
        on_complete: OnComplete | None = None,
    ) -> list[int]:
        results = [TIMED_OUT] * len(requests)
        futures = {self._pool.submit(_execute, r): i for i, r in enumerate(requests)}
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
        self._pool.shutdown(wait=False, cancel_futures=True)
