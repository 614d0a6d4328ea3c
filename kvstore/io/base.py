"""The I/O engine interface: how a batch of positioned reads and writes goes out.

Tiers describe work as IoRequests and hand a whole batch to `run`, which keeps up
to `queue_depth` of them in flight (per file, and for a batch with completion work a
quarter of the file's share where that is less: `Gate`) and returns one result per
request: the bytes transferred, or -errno.
Engines never raise for a failed request, so one bad sector costs one chunk, not
the batch. A request still running at the deadline reports -ETIMEDOUT; its buffers
may still be written by the kernel later, so a caller must treat them as lost (the
disk tier reads into scratch it owns).
"""

from __future__ import annotations

import abc
import errno
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class IoRequest:
    fd: int
    offset: int
    buffers: list[memoryview]
    write: bool = False

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.buffers)


TIMED_OUT = -errno.ETIMEDOUT
# Called in the thread that called `run`, once per finished request, as it finishes,
# so work on a finished buffer (checksum, copy) overlaps the reads still in flight.
OnComplete = Callable[[int, int], None]
IN_FLIGHT_FLOOR = 16  # requests a file of a read batch keeps in flight at least (up to queue_depth)


class IoEngine(abc.ABC):
    name: str = "abstract"
    one_queue: bool = False  # every file shares one queue of queue_depth (a ring), not one each

    def __init__(self, queue_depth: int) -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        self.queue_depth = queue_depth

    def in_flight(self, count: int, on_complete: OnComplete | None) -> int:
        """Requests of one file's `count` in a batch to keep in flight: at most
        `queue_depth`, and where there is completion work, a quarter of them (at least
        IN_FLIGHT_FLOOR). A device may complete what it holds all at once (this
        machine's virtual disk returns 64 reads sent at once all together), and a batch
        sent out whole then has its on_complete work (a record's checksum) run after its
        last read; held to a quarter, each quarter's checks run while the next quarter
        is read, and only the last quarter's follow."""
        if on_complete is None:
            return min(self.queue_depth, count)
        return min(self.queue_depth, count, max(IN_FLIGHT_FLOOR, -(-count // 4)))

    def gate(self, requests: Sequence[IoRequest], on_complete: OnComplete | None) -> Gate:
        """The batch's gate: each file's bound is `in_flight` of its share and, where the
        files share one queue, no more than an even part of it."""
        return Gate(requests, lambda count: self.in_flight(count, on_complete),
                    self.queue_depth if self.one_queue else None)

    @abc.abstractmethod
    def run(self, requests: Sequence[IoRequest], timeout_s: float | None = None,
            on_complete: OnComplete | None = None) -> list[int]:
        """Execute every request; result i is bytes moved for request i, or -errno.

        `on_complete(i, result)` is not called for requests that time out.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release rings or threads; the engine is unusable afterwards."""


class Gate:
    """Which of a batch's requests may go out now: each file descriptor is held to its
    own bound (`bound` of its share of the batch; where the files share one queue of
    `shared` entries, no more than an even part of it), so a device whose requests never
    return holds back only its own, never another device's in the same batch (the
    disk tier stripes a batch across devices). Invariant: a file's requests out and not
    finished never exceed its bound; each request is taken once (or given back)."""

    def __init__(self, requests: Sequence[IoRequest], bound: Callable[[int], int],
                 shared: int | None = None) -> None:
        self._fds = [request.fd for request in requests]
        self._waiting: dict[int, deque[int]] = {}
        for index, fd in enumerate(self._fds):
            self._waiting.setdefault(fd, deque()).append(index)
        part = len(self._fds) if shared is None else max(1, shared // max(1, len(self._waiting)))
        self._room = {fd: min(bound(len(waiting)), part) for fd, waiting in self._waiting.items()}

    def take(self) -> int | None:
        """The next request that may go out (counted as out), None while none may."""
        for fd, waiting in self._waiting.items():
            if waiting and self._room[fd] > 0:
                self._room[fd] -= 1
                return waiting.popleft()
        return None

    def give_back(self, index: int) -> None:
        """A request taken that could not go out (a full ring): first in line again."""
        self._waiting[self._fds[index]].appendleft(index)
        self._room[self._fds[index]] += 1

    def finished(self, index: int) -> None:
        self._room[self._fds[index]] += 1
