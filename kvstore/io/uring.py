"""`uring` engine: batches of readv/writev through io_uring (kvstore.io.ring).

Each calling thread gets its own ring, so concurrent callers (a get and the
write-behind flusher) never share submission state. A ring is closed when its
thread ends (the service serves each client on a thread of its own: rings must not
pile up with clients). Completions are awaited by polling an eventfd registered
with the ring: poll() releases the GIL, so every other Python thread runs while
this one waits. Each request is landed (base.py) as its completion is reaped; at the
deadline what is in flight is cancelled, and a ring whose requests will not die within a
grace is set aside: a thread of its own lands each as it completes, then closes it.
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
        # in it: its thread (`_land_late`) holds a set-aside ring till the last lands.
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


# In flight on a ring: user_data -> the request and its iovecs (kept while the kernel may read them).
_InFlight = dict[int, tuple[IoRequest, ctypes.Array]]


def _land_late(ring: _Ring, in_flight: _InFlight) -> None:
    """A set-aside ring's own thread: each request stuck past its deadline lands as its
    completion comes (its memory goes back then, never before); then the ring closes."""
    while True:
        for index, _ in ring.ring.reap():  # before each wait: the grace may have read the eventfd
            entry = in_flight.pop(index, None)
            if entry is not None:
                entry[0].landed()
        if not in_flight:
            break
        ring.wait(None)
    ring.close()


class UringEngine(IoEngine):
    name = "uring"
    one_queue = True  # one ring per thread, for every file

    def __init__(self, queue_depth: int) -> None:
        super().__init__(queue_depth)
        self._local = threading.local()
        self._rings: weakref.WeakSet[_Ring] = weakref.WeakSet()  # the live threads' rings
        self._lock = threading.Lock()
        self._ring()  # fail now, in the constructor, if io_uring is unavailable

    def _ring(self) -> _Ring:
        ring = getattr(self._local, "ring", None)
        if ring is None:
            ring = _Ring(self.queue_depth)
            self._local.ring = ring
            with self._lock:
                self._rings.add(ring)
        return ring

    def _run(self, requests: Sequence[IoRequest], timeout_s: float | None,
             on_complete: OnComplete | None) -> list[int]:
        ring = self._ring()
        results = [TIMED_OUT] * len(requests)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        in_flight: _InFlight = {}
        gate = self.gate(requests, on_complete)
        self._fill(ring, requests, gate, in_flight)
        while in_flight:
            completed = ring.ring.reap()
            if not completed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self._cancel(ring, in_flight)
                    break
                ring.wait(remaining)
                continue
            done = []
            for index, result in completed:
                entry = in_flight.pop(index, None)
                if entry is None:
                    continue  # an earlier cancel's own completion
                entry[0].landed()
                gate.finished(index)
                results[index] = result
                done.append((index, result))
            # Refill the queue before the callbacks: the device reads the next chunks
            # while this thread verifies and copies the finished ones.
            self._fill(ring, requests, gate, in_flight)
            if on_complete is not None:
                for index, result in done:
                    on_complete(index, result)
        for index in gate.unsent():  # the deadline came first: never sent, nothing touched them
            requests[index].landed()
        return results

    def _fill(self, ring: _Ring, requests: Sequence[IoRequest], gate: Gate, in_flight: _InFlight) -> None:
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
            in_flight[index] = request, iovecs
            queued += 1
        if queued:
            ring.ring.submit()

    def _cancel(self, ring: _Ring, in_flight: _InFlight) -> None:
        """Deadline passed: cancel what is in flight, landing what ends within the grace; a
        ring still holding requests after it is set aside (`_land_late`), never reused."""
        for index in in_flight:
            ring.ring.queue(R.OP_ASYNC_CANCEL, -1, index, 0, 0, _CANCEL_USER_DATA)
        ring.ring.submit()
        grace_end = time.monotonic() + _CANCEL_GRACE_S
        while in_flight and time.monotonic() < grace_end:
            for index, _ in ring.ring.reap():
                entry = in_flight.pop(index, None)
                if entry is not None:
                    entry[0].landed()
            if in_flight:
                ring.wait(grace_end - time.monotonic())
        if in_flight:
            log.warning("io_uring: %d requests stuck past their deadline; their ring is set aside "
                        "until they land", len(in_flight))
            self._local.ring = None
            with self._lock:
                self._rings.discard(ring)
            threading.Thread(target=_land_late, args=(ring, in_flight), name="kvstore-io-late",
                             daemon=True).start()

    def close(self) -> None:
        with self._lock:
            rings = list(self._rings)
            self._rings.clear()
        for ring in rings:
            ring.close()
