"""The I/O engine interface: how a batch of positioned reads and writes goes out, and
who owns the memory they move.

Tiers describe work as IoRequests and hand a whole batch to `run`, which keeps up
to `queue_depth` of them in flight (per file, and for a batch with completion work a
quarter of the file's share where that is less: `Gate`) and returns one result per
request: the bytes transferred, or -errno.
Engines never raise for a failed request, so one bad sector costs one chunk, not
the batch. A request still running at the deadline reports -ETIMEDOUT, and its caller
returns without waiting for it.

Late I/O is a rule of these types, not of each caller. Invariants:
- Memory reaches an engine only as an IoBuffer, and each request holds its IoBuffers
  from `run` until its engine lands it (`IoRequest.landed`: the kernel or a worker is
  done with it, or it was never sent), whether its caller waited or its deadline came
  first. Only engines (kvstore/io) land a request, once.
- An IoBuffer goes back where it came from (`give_back`: a staging pool, a DRAM slot's
  pin, a map to unmap) when its maker has closed it and every request holding it has
  landed, never before. So a caller whose read timed out closes its buffers as after a
  hit, and memory a late read may still write (or a late write still read) is reused
  or freed only once that I/O has landed: early reuse is not a case a caller handles.
  (foyer's engines, which take a buffer and hand it back with the result, are the model.)
"""

from __future__ import annotations

import abc
import errno
import threading
from collections import deque
from collections.abc import Callable, Sequence

# Every IoBuffer's count of holders changes under this lock, here only (a few instructions
# a time: one acquisition per batch lent, per request landed, per buffer closed).
_HOLDS = threading.Lock()


class IoBuffer:
    """Memory I/O moves bytes into or out of (`views`), held by its maker until `close`
    and by each request it is lent to until that request lands. The last to let go calls
    `give_back(self)`; if the maker closed first (the I/O outlived its caller's wait),
    `late` is set and `on_late(self)` is called as the maker closes."""

    __slots__ = ("_give_back", "_holders", "_on_late", "late", "views")

    def __init__(self, views: list[memoryview], give_back: Callable[[IoBuffer], None] | None = None,
                 on_late: Callable[[IoBuffer], None] | None = None) -> None:
        self.views = views
        self.late = False
        self._give_back = give_back
        self._on_late = on_late
        self._holders = 1  # the maker until it closes, plus each request holding it

    def close(self) -> None:
        """The maker is done with it (a second close does nothing): back now, or as the
        last request holding it lands."""
        with _HOLDS:
            if self.late or self._holders == 0:
                return
            self._holders -= 1
            self.late = self._holders > 0
        if self.late:
            if self._on_late is not None:
                self._on_late(self)
        elif self._give_back is not None:
            self._give_back(self)


_NEW, _LENT, _LANDED = range(3)  # an IoRequest's hold on its memory: not yet, held, let go


class IoRequest:
    """One positioned read or write of `buffers`: all of `memory`'s views, or the parts of
    them given as `views`. From `run` (`lend`) until its engine lands it (`landed`) it
    holds its memory, so nothing can reuse or free it while the I/O may move its bytes."""

    __slots__ = ("_state", "buffers", "fd", "memory", "offset", "write")

    def __init__(self, fd: int, offset: int, memory: Sequence[IoBuffer], write: bool = False,
                 views: list[memoryview] | None = None) -> None:
        self.fd = fd
        self.offset = offset
        self.memory = memory
        self.buffers = views if views is not None else [v for m in memory for v in m.views]
        self.write = write
        self._state = _NEW

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.buffers)

    @staticmethod
    def lend(requests: Sequence[IoRequest]) -> None:
        """The requests take their memory (again, by an engine another one wraps: nothing)."""
        with _HOLDS:
            for request in requests:
                if request._state == _NEW:
                    request._state = _LENT
                    for memory in request.memory:
                        memory._holders += 1
                elif request._state == _LANDED:
                    raise ValueError("an I/O request runs once: make a new one")

    def landed(self) -> None:
        """No I/O can touch its memory any more: the request lets go of it (once)."""
        last = []
        with _HOLDS:
            if self._state != _LENT:
                return
            self._state = _LANDED
            for memory in self.memory:
                memory._holders -= 1
                if memory._holders == 0:
                    last.append(memory)
        for memory in last:
            if memory._give_back is not None:
                memory._give_back(memory)


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

    def run(self, requests: Sequence[IoRequest], timeout_s: float | None = None,
            on_complete: OnComplete | None = None) -> list[int]:
        """Execute every request; result i is bytes moved for request i, or -errno.

        `on_complete(i, result)` is not called for requests that time out. Each request
        holds its memory from here until the engine lands it: before this returns, or,
        for one the kernel or a worker still has at the deadline, as it finishes.
        """
        IoRequest.lend(requests)
        return self._run(requests, timeout_s, on_complete)

    @abc.abstractmethod
    def _run(self, requests: Sequence[IoRequest], timeout_s: float | None,
             on_complete: OnComplete | None) -> list[int]:
        """`run` after its requests are lent; lands each exactly once, sent or not."""

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

    def unsent(self) -> list[int]:
        """The requests never taken (their caller's deadline came first), taken now."""
        left = [index for waiting in self._waiting.values() for index in waiting]
        for waiting in self._waiting.values():
            waiting.clear()
        return left
