"""The I/O engine interface: how a batch of positioned reads and writes goes out.

Tiers describe work as IoRequests and hand a whole batch to `run`, which keeps up
to `queue_depth` of them in flight (a quarter of the batch where that is less:
`in_flight`) and returns one result per request: the bytes transferred, or -errno.
Engines never raise for a failed request, so one bad sector costs one chunk, not
the batch. A request still running at the deadline reports -ETIMEDOUT; its buffers
may still be written by the kernel later, so a caller must treat them as lost (the
disk tier reads into scratch it owns).
"""

from __future__ import annotations

import abc
import errno
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
IN_FLIGHT_FLOOR = 16  # requests a batch keeps in flight at least (up to queue_depth)


class IoEngine(abc.ABC):
    name: str = "abstract"

    def __init__(self, queue_depth: int) -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        self.queue_depth = queue_depth

    def in_flight(self, count: int) -> int:
        """Requests of a batch of `count` to keep in flight: a quarter of the batch (at
        least IN_FLIGHT_FLOOR), at most `queue_depth`. A device may complete what is in
        flight all at once (the development machine's virtual disk completes a whole
        submission together), and a batch sent out whole then has its on_complete work
        (a record's checksum) run after its last read; held to a quarter, each quarter's
        checks run while the next quarter is read, and only the last quarter's follow."""
        return min(self.queue_depth, count, max(IN_FLIGHT_FLOOR, -(-count // 4)))

    @abc.abstractmethod
    def run(self, requests: Sequence[IoRequest], timeout_s: float | None = None,
            on_complete: OnComplete | None = None) -> list[int]:
        """Execute every request; result i is bytes moved for request i, or -errno.

        `on_complete(i, result)` is not called for requests that time out.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release rings or threads; the engine is unusable afterwards."""
