"""The stall meter the deadline cases subtract (tests/support/stalls.py): it counts a
stall of the machine, and the kernel's count of memory stalls, but never the call's own
time."""

from __future__ import annotations

import os
import signal
import time

from support import stalls
from support.stalls import memory_stalled, stall_meter


def test_a_stopped_machine_is_counted_and_a_slow_call_is_not(tmp_path):
    """The meter stopped for 1 s during a call (as a starved machine leaves it) counts
    about 1 s; a call that only sleeps 1 s counts none of it."""
    with stall_meter(tmp_path) as meter:
        _, seconds, stalled = meter.timed(lambda: time.sleep(1.0))
        assert seconds >= 1.0 and stalled < 0.2, stalled

        def starved() -> None:
            os.kill(meter.pid, signal.SIGSTOP)
            time.sleep(1.0)
            os.kill(meter.pid, signal.SIGCONT)

        _, seconds, stalled = meter.timed(starved)
        assert 0.7 <= stalled <= seconds, (stalled, seconds)


def test_memory_stalls_are_read_from_the_kernels_pressure_count(tmp_path, monkeypatch):
    """/proc/pressure/memory's `full` total, in seconds; 0 where the kernel has none."""
    pressure = tmp_path / "memory"
    pressure.write_text("some avg10=1.00 avg60=0.50 avg300=0.10 total=9000000\n"
                        "full avg10=0.50 avg60=0.20 avg300=0.05 total=2500000\n")
    monkeypatch.setattr(stalls, "MEMORY_PRESSURE", pressure)
    assert memory_stalled() == 2.5
    monkeypatch.setattr(stalls, "MEMORY_PRESSURE", tmp_path / "none")
    assert memory_stalled() == 0.0
