"""`threads` engine: os.preadv/os.pwritev on bounded worker threads, one set per file.

Works everywhere (containers often forbid io_uring). The syscalls release the
GIL, so `queue_depth` workers keep that many requests at the device. Workers are
per file descriptor, so a device whose requests never return (a lost NVMe-oF
path) ties up its own workers, at most `queue_depth`, never another device's.
They are daemon threads: a worker stuck in uninterruptible sleep must not keep
the process from exiting (a ThreadPoolExecutor joins its workers at exit).
A worker lands each request it takes as its syscall returns (base.py: its memory goes
back then, whether or not the caller still waits); one whose deadline passed before a
worker took it is landed without being started.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence

from kvstore.io.base import TIMED_OUT, IoEngine, IoRequest, OnComplete


def _execute(request: IoRequest) -> int:
    try:
        if request.write:
            return os.pwritev(request.fd, request.buffers, request.offset)
        return os.preadv(request.fd, request.buffers, request.offset)
    except OSError as exc:
        return -(exc.errno or 5)


# One request of a `run`: its index, the request, its caller's deadline (monotonic, or
# None) and where its result goes.
_Job = tuple[int, IoRequest, float | None, queue.SimpleQueue[tuple[int, int]]]


class _Workers:
    """`count` daemon threads serving one file descriptor's requests in FIFO order."""

    def __init__(self, fd: int, count: int) -> None:
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._work, name=f"kvstore-io-fd{fd}", daemon=True)
                        for _ in range(count)]
        for thread in self.threads:
            thread.start()

    def _work(self) -> None:
        while self._serve(self.jobs.get()):
            pass

    @staticmethod
    def _serve(job: _Job | None) -> bool:
        """One job, landed as it ends; its buffers are not kept past it (a waiting worker
        holding the last one would keep its memory mapped, and a window's descriptor open)."""
        if job is None:
            return False
        index, request, deadline, results = job
        started = deadline is None or time.monotonic() < deadline  # else no one waits for it
        result = _execute(request) if started else TIMED_OUT
        request.landed()
        results.put((index, result))
        return True

    def stop(self) -> None:
        for _ in self.threads:
            self.jobs.put(None)


class ThreadsEngine(IoEngine):
    name = "threads"

    def __init__(self, queue_depth: int) -> None:
        super().__init__(queue_depth)
        self._workers: dict[int, _Workers] = {}
        self._lock = threading.Lock()

    def _for(self, fd: int) -> _Workers:
        with self._lock:
            workers = self._workers.get(fd)
            if workers is None:
                workers = self._workers[fd] = _Workers(fd, self.queue_depth)
            return workers

    def _run(self, requests: Sequence[IoRequest], timeout_s: float | None,
             on_complete: OnComplete | None) -> list[int]:
        results = [TIMED_OUT] * len(requests)
        finished: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        gate = self.gate(requests, on_complete)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s

        def send() -> None:
            while (index := gate.take()) is not None:
                self._for(requests[index].fd).jobs.put((index, requests[index], deadline, finished))

        send()
        for _ in requests:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                index, result = finished.get(timeout=remaining)
            except queue.Empty:  # the stragglers keep TIMED_OUT; their workers land them
                for index in gate.unsent():
                    requests[index].landed()
                break
            results[index] = result
            gate.finished(index)
            send()  # the next ones out before this one's callback
            if on_complete is not None:
                on_complete(index, result)
        return results

    def close(self) -> None:
        # Never join: a worker stuck in uninterruptible sleep must not hang close().
        with self._lock:
            for workers in self._workers.values():
                workers.stop()
            self._workers.clear()
