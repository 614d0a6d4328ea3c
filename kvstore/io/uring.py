"""`uring` engine: batches of readv/writev through io_uring (kvstore.io.ring).

Each calling thread gets its own ring, so concurrent callers (a get and the
write-behind flusher) never share submission state. A ring is closed when its
thread ends (the service serves each client on a thread of its own: rings must not
pile up with clients). Completions are awaited by polling an eventfd registered
with the ring: poll() releases the GIL, so every other Python thread runs while
this one waits.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import select
import threading
import time
import weakref
from collections.abc import Sequence

from kvstore.io import ring as R
from kvstore.io.base import TIMED_OUT, Gate, IoEngine, IoRequest, OnComplete

log = logging.getLogger(__name__)
_CANCEL_GRACE_S = 1.0
_CANCEL_USER_DATA = 1 << 62  # a cancel's own completion, never a request index


class _Ring:
    """One io_uring instance plus the eventfd its completions signal."""

    def __init__(self, entries: int) -> None:
        try:
            self.ring = R.Ring(entries, R.SETUP_COOP_TASKRUN | R.SETUP_SINGLE_ISSUER)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.ring = R.Ring(entries)  # kernels before 6.0 lack these flags
        self.eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.ring.register_eventfd(self.eventfd)
        self.poller = select.poll()
        self.poller.register(self.eventfd, select.POLLIN)
        # Closed when the last reference goes: its thread ended (thread-local storage is
        # dropped with the thread) or the engine closed. Never while a request is stuck
        # in it: the engine keeps a retired ring referenced forever.
        self._closer = weakref.finalize(self, _close_ring, self.ring, self.eventfd)

    def wait(self, timeout_s: float | None) -> None:
        self.poller.poll(None if timeout_s is None else max(0, int(timeout_s * 1000)))
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.eventfd)

    def close(self) -> None:
        self._closer()


def _close_ring(ring: R.Ring, eventfd: int) -> None:
    ring.close()
    os.close(eventfd)


class UringEngine(IoEngine):
    name = "uring"
    one_queue = True  # one ring per thread, for every file

    def __init__(self, queue_depth: int) -> None:
        super().__init__(queue_depth)
        self._local = threading.local()
        self._rings: weakref.WeakSet[_Ring] = weakref.WeakSet()  # the live threads' rings
        self._lock = threading.Lock()
        self._leaked: list[object] = []  # retired rings, and buffers of requests stuck in them
        self._ring()  # fail now, in the constructor, if io_uring is unavailable

    def _ring(self) -> _Ring:
        ring = getattr(self._local, "ring", None)
        if ring is None:
            ring = _Ring(self.queue_depth)
            self._local.ring = ring
            with self._lock:
                self._rings.add(ring)
        return ring

    def run(self, requests: Sequence[IoRequest], timeout_s: float | None = None,
            on_complete: OnComplete | None = None) -> list[int]:
        ring = self._ring()
        results = [TIMED_OUT] * len(requests)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        in_flight: dict[int, object] = {}  # user_data -> iovecs kept alive until completion
        gate = self.gate(requests, on_complete)
        self._fill(ring, requests, gate, in_flight)
        while in_flight:
            completed = ring.ring.reap()
            if not completed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self._abandon(ring, in_flight)
                    break
                ring.wait(remaining)
                continue
            done = []
            for index, result in completed:
                if in_flight.pop(index, None) is None:
                    continue  # a completion left over from an earlier cancel
                gate.finished(index)
                results[index] = result
                done.append((index, result))
            # Refill the queue before the callbacks: the device reads the next chunks
            # while this thread verifies and copies the finished ones.
            self._fill(ring, requests, gate, in_flight)
            if on_complete is not None:
                for index, result in done:
                    on_complete(index, result)
        return results

    def _fill(self, ring: _Ring, requests: Sequence[IoRequest], gate: Gate,
              in_flight: dict[int, object]) -> None:
        """Queue what the gate lets out, `queue_depth` in flight at most (the ring's size);
        submit them."""
        queued = 0
        while len(in_flight) < self.queue_depth and (index := gate.take()) is not None:
            request = requests[index]
            iovecs = R.iovecs(request.buffers)
            opcode = R.OP_WRITEV if request.write else R.OP_READV
            if not ring.ring.queue(opcode, request.fd, ctypes.addressof(iovecs), len(iovecs),
                                   request.offset, index):
                gate.give_back(index)
                break
            in_flight[index] = iovecs
            queued += 1
        if queued:
            ring.ring.submit()

    def _abandon(self, ring: _Ring, in_flight: dict[int, object]) -> None:
        """Deadline passed: cancel what is in flight; if it will not die, retire the ring.

        A request the kernel still owns may write its buffers later, so its iovec
        (and through it the buffers) is kept alive forever rather than freed.
        """
        for index in in_flight:
            ring.ring.queue(R.OP_ASYNC_CANCEL, -1, index, 0, 0, _CANCEL_USER_DATA)
        ring.ring.submit()
        grace_end = time.monotonic() + _CANCEL_GRACE_S
        while in_flight and time.monotonic() < grace_end:
            for index, _ in ring.ring.reap():
                in_flight.pop(index, None)
            if in_flight:
                ring.wait(grace_end - time.monotonic())
        if in_flight:
            log.warning("io_uring: %d requests stuck past their deadline; retiring the ring",
                        len(in_flight))
            self._leaked.extend([ring, *in_flight.values()])  # never closed, never reused
            self._local.ring = None
            with self._lock:
                self._rings.discard(ring)

    def close(self) -> None:
        with self._lock:
            rings = list(self._rings)
            self._rings.clear()
        for ring in rings:
            ring.close()
