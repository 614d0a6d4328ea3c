"""A test run stopped by SIGTERM tears its fixtures down, as on Ctrl-C.

`timeout` and a cancelled CI job stop a run with SIGTERM to its process group (pytest and
its xdist workers). Its default action ends each at once, with no teardown, while the
servers tests start (vLLM's, LMCache's MP server, the kvstore service, engine fork
servers) run in sessions of their own so that their whole group can be stopped: they
live on, reparented to init, holding gigabytes, and a later run's SGLang server finds no
free host memory. Raised as KeyboardInterrupt, the signal unwinds the test in progress
and pytest's session end stops every fixture's server.
"""

from __future__ import annotations

import signal
from types import FrameType


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def tear_down_on_sigterm() -> None:
    """SIGTERM becomes KeyboardInterrupt in this process's main thread (call it from there)."""
    signal.signal(signal.SIGTERM, _interrupt)
