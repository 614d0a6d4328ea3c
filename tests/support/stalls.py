"""How long the machine left a sleeping process unscheduled, so that a case which times a
call against a deadline fails on the code under test, not on a test beside it that
starved the machine (a CI run on 2 cores, next to vLLM and SGLang servers: a frozen-service
load once took 9.1 s there, where it takes 4.0-4.7 s on the same machine under a vLLM
server's load).

The meter is a process of its own, not a thread: a thread of the process under test
could not wake while that process held its GIL, and would excuse the very hang a
deadline test is there to find. A machine short of memory stalls the process under test
(its pages reclaimed and read back) long before the meter's few hot pages: so the time
the kernel saw every task of the machine stalled on memory (PSI's `full`, where the
kernel has it) counts as stalled too, whichever of the two is larger."""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
TICK_S = 0.02  # the meter's sleep
GRACE_S = 0.05  # lateness per tick that is the ordinary cost of a busy machine, not a stall
MEMORY_PRESSURE = Path("/proc/pressure/memory")

# Sums each wake's lateness past the grace into the file's first 8 bytes; ends with its parent.
_LOOP = f"""
import os, struct, sys, time
fd, parent, total = os.open(sys.argv[1], os.O_WRONLY), os.getppid(), 0.0
while os.getppid() == parent:
    started = time.monotonic()
    time.sleep({TICK_S})
    total += max(0.0, time.monotonic() - started - {TICK_S} - {GRACE_S})
    os.pwrite(fd, struct.pack("d", total), 0)
"""


class StallMeter:
    """A process that sleeps TICK_S at a time and adds up how late it woke (past GRACE_S)."""

    def __init__(self, folder: Path) -> None:
        self._path = folder / f"stalls-{os.getpid()}-{time.monotonic_ns()}"
        self._path.write_bytes(struct.pack("d", 0.0))
        self._process = subprocess.Popen([sys.executable, "-I", "-c", _LOOP, str(self._path)])

    @property
    def pid(self) -> int:
        """The meter's process (stopped, it plays a starved machine: tests/test_stalls.py)."""
        return self._process.pid

    def stalled(self) -> float:
        """Seconds of stall seen so far."""
        value: float = struct.unpack("d", self._path.read_bytes()[:8])[0]
        return value

    def timed(self, call: Callable[[], T]) -> tuple[T, float, float]:
        """(call's result, its seconds, the seconds of them the machine was stalled). It
        waits a few ticks after the call, so a stall that ends with the call is counted."""
        before, memory = self.stalled(), memory_stalled()
        started = time.monotonic()
        result = call()
        seconds = time.monotonic() - started
        time.sleep(3 * TICK_S)
        return result, seconds, min(seconds, max(self.stalled() - before, memory_stalled() - memory))

    def close(self) -> None:
        self._process.kill()
        self._process.wait()
        self._path.unlink(missing_ok=True)


def memory_stalled() -> float:
    """Seconds since boot that every non-idle task of the machine was stalled on memory
    (/proc/pressure/memory's `full` total); 0 where the kernel keeps no such count."""
    try:
        for line in MEMORY_PRESSURE.read_text().splitlines():
            if line.startswith("full "):
                return int(line.rsplit("total=", 1)[1]) / 1e6
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


@contextlib.contextmanager
def stall_meter(folder: Path) -> Iterator[StallMeter]:
    meter = StallMeter(folder)
    try:
        yield meter
    finally:
        meter.close()
