"""A throwaway redis-server on a loopback port, in a directory of its own, for the cluster
tests and `python -m bench.cluster_bench`: persistence off (the index is a hint, nothing
in it needs to survive), paused and resumed with signals, stopped even when paused.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path


def redis_server_unavailable() -> str | None:
    """Why no redis-server can be started here, or None."""
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (scripts/setup.sh installs it with apt, as root)"
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start on a free port (a new one each time: another test may take the old one)."""
        for _ in range(5):
            if self._launch(_free_port()):
                return
        raise RuntimeError(f"redis-server did not start (see {self.workdir})")

    def restart(self) -> None:
        """Stop and start again on the same port (the clients' URL stays valid)."""
        self.stop()
        if not self._launch(self.port):
            raise RuntimeError(f"redis-server did not come back (see {self.workdir})")

    def _launch(self, port: int) -> bool:
        self.port = port
        self.process = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir),
             "--logfile", str(self.workdir / f"redis-{port}.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.process.poll() is None:
            if self._answers():
                return True
            time.sleep(0.02)
        self.stop()
        return False

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def pause(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGCONT)
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None
