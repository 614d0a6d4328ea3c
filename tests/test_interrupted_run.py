"""A test run stopped by SIGTERM (as `timeout` stops one) leaves no server behind: the
fixture that started it in a session of its own still stops it (support/interrupt.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.support.processes import ROOT

CONFTEST = """
from support.interrupt import tear_down_on_sigterm


def pytest_configure(config):
    tear_down_on_sigterm()
"""

TEST = """
import time
from pathlib import Path

import pytest

from bench.support.processes import start_group, stop_group


@pytest.fixture
def server(tmp_path):
    process = start_group(["sleep", "600"], tmp_path / "server.log", {{}})
    yield process
    stop_group(process, timeout_s=5)


def test_runs_until_stopped(server):
    Path({pid_file!r}).write_text(str(server.pid))
    time.sleep(600)
"""

HANGING = """
import time
from pathlib import Path

import pytest


@pytest.fixture
def stuck():
    yield
    Path({pid_file!r}).write_text("tearing down")
    time.sleep(600)


def test_runs_until_stopped(stuck):
    Path({pid_file!r}).write_text("running")
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _run(tmp_path: Path, test: str) -> subprocess.Popen[str]:
    """pytest on `test` (its text), with the project's handler, in a process of its own."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_it.py").write_text(test)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
               "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "inner"), "-o", "timeout=120",
               str(tmp_path / "test_it.py")]
    return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _wait_for(run: subprocess.Popen[str], path: Path, text: str = "") -> str:
    deadline = time.monotonic() + 60
    while not path.exists() or not path.read_text() or (text and path.read_text() != text):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate(timeout=10)[0]
        time.sleep(0.1)
    return path.read_text()


def test_a_run_stopped_by_sigterm_stops_the_servers_its_fixtures_started(tmp_path):
    pid_file = tmp_path / "server.pid"
    run = _run(tmp_path, TEST.format(pid_file=str(pid_file)))
    server = 0
    try:
        server = int(_wait_for(run, pid_file))
        run.send_signal(signal.SIGTERM)
        output = run.communicate(timeout=60)[0]
        assert not _alive(server), f"the server outlived the run:\n{output}"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        if server and _alive(server):
            os.killpg(server, signal.SIGKILL)


def test_a_second_sigterm_ends_a_run_whose_teardown_hangs(tmp_path):
    """The interrupt never makes a stopped run hang: a second SIGTERM ends it at once."""
    state = tmp_path / "state"
    run = _run(tmp_path, HANGING.format(pid_file=str(state)))
    try:
        _wait_for(run, state, "running")
        run.send_signal(signal.SIGTERM)
        _wait_for(run, state, "tearing down")
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=30) == -signal.SIGTERM
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
