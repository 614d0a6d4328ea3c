"""A test run stopped by SIGTERM tears its fixtures down, as on Ctrl-C.

`timeout` and a cancelled CI job stop a run with SIGTERM to its process group (pytest and
its xdist workers). Its default action ends each at once, with no teardown, while the
servers tests start (vLLM's, LMCache's MP server, the kvstore service, engine fork
servers) run in sessions of their own so that their whole group can be stopped: they
live on, reparented to init, holding gigabytes, and a later run's SGLang server finds no
free host memory. Raised as KeyboardInterrupt, the signal unwinds the test in progress
and pytest's session end stops every fixture's server.

The teardown has a deadline of its own: a second SIGTERM ends the process at once, and
past TEARDOWN_S the stacks are dumped and the process exits, so a teardown that hangs
never makes a stopped run hang. A child forked without exec (a test's) dies of the
signal as before, instead of unwinding a copy of pytest.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from types import FrameType

TEARDOWN_S = 120.0  # the servers' own stops take up to 30 s each (bench/support/processes.py)


def _default() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    _default()  # a second SIGTERM ends the process
    faulthandler.dump_traceback_later(TEARDOWN_S, exit=True)
    raise KeyboardInterrupt(f"signal {signum}")


def tear_down_on_sigterm() -> None:
    """SIGTERM becomes KeyboardInterrupt in this process's main thread (call it from there)."""
    signal.signal(signal.SIGTERM, _interrupt)
    os.register_at_fork(after_in_child=_default)
