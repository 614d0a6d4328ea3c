"""Engine runs forked from a process that has imported vLLM (bench/support/engine_fork.py)
are processes of their own: their own arguments, directory, environment, process group
(killed whole past a deadline), pipes and no other file of the server's, exit code and
exit handlers; a run whose environment differs from the server's, a caller
of another user, or a malformed request is refused, and the server serves on. On a real
engine, a forked run answers as a run started cold does, to the bit."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bench.support.engine_fork import SOCKET_ENV, fork_run
from bench.support.engine_run import run_fresh
from bench.support.tiny_model import build_tiny_llama, prompt_token_ids

SERVER = textwrap.dedent("""
    import atexit, json, os, subprocess, sys, time
    from bench.support.engine_fork import serve

    def prepare():
        os.environ["SET_BY_IMPORTS"] = "yes"

    def main(argv):
        atexit.register(lambda: print("exit handler ran", flush=True))
        print(json.dumps({"argv": list(argv), "cwd": os.getcwd(), "pid": os.getpid(),
                          "group": os.getpgid(0), "per_run": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
                          "imported": os.environ.get("SET_BY_IMPORTS"),
                          "fds": sorted(map(int, os.listdir("/proc/self/fd")))}), flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        if argv[:1] == ["sleep"]:
            child = subprocess.Popen(["sleep", "60"])
            with open("grandchild", "w") as f:
                f.write(str(child.pid))
            time.sleep(60)
        return 3

    serve(sys.argv[1], prepare, main)
""")


WORDS = st.one_of(st.text(max_size=5), st.integers())


def wait_for_socket(path: Path, server: subprocess.Popen[bytes] | None = None,
                    timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert server is None or server.poll() is None, "the fork server exited"
        assert time.monotonic() < deadline, "the fork server did not start serving"
        time.sleep(0.05)


@contextlib.contextmanager
def serving(path: Path) -> Iterator[Path]:
    """A fork server of a small `main` (above) at `path`, for this process's runs."""
    os.environ[SOCKET_ENV] = str(path)
    process = subprocess.Popen([sys.executable, "-c", SERVER, str(path)], env=dict(os.environ),
                               cwd=Path(__file__).resolve().parent.parent, start_new_session=True)
    try:
        wait_for_socket(path, process)
        yield path
    finally:
        process.kill()
        process.wait()


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv(SOCKET_ENV, "")  # restored after the test
    with serving(tmp_path / "fork.sock") as path:
        yield path


def test_a_forked_run_is_a_process_of_its_own(server: Path, tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    other = fork_run(["sleep"], dict(os.environ), str(tmp_path / "other"))  # a run the server watches
    assert other is not None
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="7")  # read per run: may differ from the server's
    run = fork_run(["one", "two"], env, str(tmp_path))
    assert run is not None
    out, err = run.communicate(timeout=30)
    os.killpg(other.pid, signal.SIGKILL)
    other.communicate(timeout=30)
    seen = json.loads(out.splitlines()[0])
    # only its stdin, its two pipes and the listing's own fd: nothing of the server's or the other run's
    assert seen == {"argv": ["one", "two"], "cwd": str(tmp_path), "pid": run.pid, "group": run.pid,
                    "per_run": "7", "imported": "yes", "fds": [0, 1, 2, 3]}
    assert "exit handler ran" in out  # it ends as a process does: a connector's queued saves drain
    assert "to stderr" in err
    assert run.returncode == 3
    assert (server.stat().st_mode & 0o777) == 0o600


def test_a_run_whose_environment_differs_is_not_forked(server: Path, tmp_path: Path) -> None:
    assert fork_run(["x"], dict(os.environ, HF_HUB_OFFLINE="0", OTHER="1"), str(tmp_path)) is None
    # a variable importing vLLM sets: the caller's own value would be lost in a fork
    assert fork_run(["x"], dict(os.environ, SET_BY_IMPORTS="no"), str(tmp_path)) is None
    run = fork_run(["x"], dict(os.environ, SET_BY_IMPORTS="yes"), str(tmp_path))  # as after the imports
    assert run is not None
    run.communicate(timeout=30)
    assert run.returncode == 3


def test_a_run_is_its_own_group_as_soon_as_its_pid_is_known(server: Path, tmp_path: Path) -> None:
    run = fork_run(["sleep"], dict(os.environ), str(tmp_path))
    assert run is not None
    os.killpg(run.pid, signal.SIGKILL)  # at once: the group exists before the caller hears the pid
    run.communicate(timeout=30)
    assert run.returncode == -signal.SIGKILL


def test_a_run_past_its_deadline_is_killed_with_its_group(server: Path, tmp_path: Path) -> None:
    run = fork_run(["sleep"], dict(os.environ), str(tmp_path))
    assert run is not None
    with pytest.raises(subprocess.TimeoutExpired):
        run.communicate(timeout=1.0)
    grandchild = int((tmp_path / "grandchild").read_text())
    os.killpg(run.pid, signal.SIGKILL)  # what run_fresh does past its deadline
    run.communicate(timeout=30)
    assert run.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while running(grandchild):
        assert time.monotonic() < deadline, "the run's own child outlived the kill of its group"
        time.sleep(0.05)


def running(pid: int) -> bool:
    """The process is there and not a zombie (killed, not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_no_server_no_fork(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SOCKET_ENV, raising=False)
    assert fork_run(["x"], dict(os.environ), str(tmp_path)) is None
    monkeypatch.setenv(SOCKET_ENV, str(tmp_path / "missing.sock"))
    assert fork_run(["x"], dict(os.environ), str(tmp_path)) is None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=st.one_of(
    st.binary(max_size=256),
    st.builds(lambda argv, env, cwd: json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode(),
              st.one_of(st.none(), st.lists(WORDS, max_size=3)),
              st.one_of(st.none(), st.dictionaries(st.text(max_size=5), WORDS, max_size=3)),
              st.one_of(st.none(), WORDS))),
    with_pipes=st.booleans())
@example(request=b"[" * 100_000, with_pipes=True)  # JSON nested past the parser's stack
def test_malformed_requests_are_refused_and_the_server_serves_on(server: Path, tmp_path: Path,
                                                                 request: bytes, with_pipes: bool) -> None:
    pipes = [os.pipe() for _ in range(2)] if with_pipes else []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.settimeout(10)
            conn.connect(str(server))
            socket.send_fds(conn, [request], [w for _, w in pipes])
            reply = conn.recv(1 << 16)
    finally:
        for fd in (fd for pipe in pipes for fd in pipe):
            os.close(fd)
    assert reply == b"" or b"refused" in reply
    run = fork_run(["x"], dict(os.environ), str(tmp_path))
    assert run is not None
    run.communicate(timeout=30)


def test_a_caller_of_another_user_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the socket's own mode (0600, above), the server asks who calls."""
    if os.getuid() != 0:
        pytest.skip("needs root to act as another user")
    monkeypatch.setenv(SOCKET_ENV, "")
    # In /tmp whatever TMPDIR says: the other user must reach the socket past the folder's mode.
    with tempfile.TemporaryDirectory(dir="/tmp") as folder, serving(Path(folder) / "fork.sock") as path:
        os.chmod(folder, 0o755)
        os.chmod(path, 0o666)
        probe = textwrap.dedent(f"""
            import json, os, socket
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            conn.connect({str(path)!r})
            out, err = os.pipe(), os.pipe()
            request = json.dumps({{"argv": [], "env": dict(os.environ), "cwd": "/"}}).encode()
            try:
                socket.send_fds(conn, [request], [out[1], err[1]])
                print(conn.recv(1 << 16) or "refused")
            except (BrokenPipeError, ConnectionResetError):
                print("refused")
        """)
        done = subprocess.run(["/usr/bin/python3", "-I", "-c", probe], user=65534, capture_output=True,
                              text=True, timeout=30, env=dict(os.environ), cwd="/")
    assert done.stdout.strip() == "refused", done.stdout + done.stderr


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_forked_engine_answers_as_a_cold_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_tiny_llama(tmp_path / "model")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([prompt_token_ids(600, seed=3)]))
    wait_for_socket(Path(os.environ[SOCKET_ENV]), timeout_s=180)  # the worker's own (tests/conftest.py)
    forked = run_fresh(model, prompts, None, single_process=True, timeout_s=300)
    monkeypatch.delenv(SOCKET_ENV)
    cold = run_fresh(model, prompts, None, single_process=True, timeout_s=300)
    assert forked.forked and not cold.forked
    assert forked.results[0]["token_ids"] == cold.results[0]["token_ids"]
    assert forked.results[0]["logprobs"] == cold.results[0]["logprobs"]
