"""Fork fresh engine runs from a process that has imported vLLM once.

A fresh engine run (engine_run.py) spends 6-7 of its ~13 s on a 2-core host importing
vLLM and torch. This server imports them and nothing more (no engine, no thread, no torch
op), then forks each run from there: the child is a new process with its own engine,
prefix cache, connector and exit, as `python -m bench.support.engine_run` would be, less
the import.

Invariants:
- The server has one Python thread and has started no engine when it forks; it refuses
  a run otherwise. The native pools its imports start (OpenBLAS's: two idle threads here)
  have their libraries' own fork handlers; that a forked engine answers as a cold one, to
  the bit, is tested (tests/test_engine_fork.py).
- A run is forked only when its environment is the one the server was started with, up to
  `PER_RUN` (variables read when a run starts, not at import) and what importing vLLM set
  (where the caller imported it too): what is read at import (HF_HUB_OFFLINE, logging,
  OMP_*) is fixed in the server. A refused run is started as a
  process of its own by `run_fresh`, so a fork never changes what a run does.
- A child leads its own process group (its pid, as `run_fresh`'s own processes do; set
  before the caller hears the pid, so a kill of the group past a deadline reaches it),
  writes to the caller's pipes, and exits as a process does (non-daemon
  threads joined, exit handlers run: the connector's queued saves drain).

Started as `python -m bench.support.engine_run --fork-server SOCKET`; `run_fresh` forks
from it when KVSTORE_ENGINE_FORK names SOCKET.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

SOCKET_ENV = "KVSTORE_ENGINE_FORK"
PER_RUN = frozenset({"PYTEST_CURRENT_TEST", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE"})
MAX_MESSAGE = 1 << 20
REQUEST_TIMEOUT_S = 5.0  # a caller that connects and says nothing holds the server no longer
HANDSHAKE_TIMEOUT_S = 10.0  # a caller waits no longer for the server's answer


def _differs(born: dict[str, str], imported: dict[str, str], env: dict[str, str]) -> list[str]:
    """Variables, outside PER_RUN, in which `env` differs from the server's: from the
    environment it was started with, unless the caller has what importing vLLM set there
    (it imported vLLM too)."""
    return sorted(k for k in born.keys() | env.keys() | imported.keys() if k not in PER_RUN
                  and env.get(k) != born.get(k) and not (k in imported and env.get(k) == imported[k]))


def serve(path: str, prepare: Callable[[], None], main: Callable[[Sequence[str]], int]) -> None:
    """Run `prepare` (the imports), then fork a run of `main` per request until killed."""
    born = dict(os.environ)
    prepare()
    imported = {k: v for k, v in os.environ.items() if born.get(k) != v}  # what importing set
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old_umask = os.umask(0o177)  # the socket is its owner's alone (callers are checked too)
    try:
        listener.bind(path + ".tmp")
    finally:
        os.umask(old_umask)
    os.rename(path + ".tmp", path)  # callers see the socket only once it is served
    listener.listen()
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                pid = _start(conn, born, imported, selector, main)
                if pid is None:
                    conn.close()
                    continue
                try:
                    selector.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, conn))
                except OSError:  # no pidfd to spare: wait for this run here
                    _ended(pid, conn)
            else:
                selector.unregister(key.fileobj)
                os.close(key.fd)
                _ended(*key.data)


def _ended(pid: int, conn: socket.socket) -> None:
    """Reap the run and tell its caller how it ended."""
    _, status = os.waitpid(pid, 0)
    _reply(conn, {"returncode": os.waitstatus_to_exitcode(status)})
    conn.close()


def _reply(conn: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the caller has gone: nobody to tell
        conn.send(json.dumps(message).encode())


def _request(conn: socket.socket) -> tuple[list[str], dict[str, str], str, list[int]] | None:
    """The run a caller of this user asks for (argv, env, cwd, its stdout and stderr), or
    None: another user, or anything malformed (its fds closed)."""
    fds: list[int] = []
    try:
        conn.settimeout(REQUEST_TIMEOUT_S)
        _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():  # another user's request would run as this one
            return None
        data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 2)
        request = json.loads(data)
        argv, env, cwd = request["argv"], request["env"], request["cwd"]
        if len(fds) == 2 and isinstance(cwd, str) and isinstance(argv, list) and isinstance(env, dict) \
                and all(isinstance(a, str) for a in [*argv, *env, *env.values()]):
            return argv, env, cwd, fds
    except Exception:  # whatever a caller sends: JSON nested past the stack too
        pass
    for fd in fds:
        os.close(fd)
    return None


def _start(conn: socket.socket, born: dict[str, str], imported: dict[str, str],
           selector: selectors.BaseSelector, main: Callable[[Sequence[str]], int]) -> int | None:
    """Fork the run `conn` asks for; its pid, or None when refused or unreadable. The
    run's environment is the caller's with what importing vLLM set in it, as a fresh
    process's would be after the same imports."""
    request = _request(conn)
    if request is None:
        return None
    argv, env, cwd, fds = request
    differs = _differs(born, imported, env)
    refused = f"environment differs in {differs}" if differs else None
    pid = -1
    if refused is None and threading.active_count() != 1:
        refused = "the server has threads: not forkable"
    if refused is None:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as error:
            refused = f"fork failed: {error.strerror}"
    if pid == 0:
        for key in list(selector.get_map().values()):  # the listener, other runs' pidfds
            if isinstance(key.fileobj, socket.socket):
                key.fileobj.close()  # through its object: a stale object closes a reused fd
            else:
                os.close(key.fd)
            if key.data is not None:
                key.data[1].close()
        selector.close()
        conn.close()
        _run_child(main, argv, env | imported, cwd, fds)
    for fd in fds:
        os.close(fd)
    if refused is not None:
        print(f"engine fork server: a run refused ({refused}); it starts cold", file=sys.stderr, flush=True)
        _reply(conn, {"refused": refused})
        return None
    with contextlib.suppress(OSError):  # the child has set it itself, or has ended already
        os.setpgid(pid, pid)  # its own group before the caller hears its pid (and may kill it)
    _reply(conn, {"pid": pid})
    return pid


def _run_child(main: Callable[[Sequence[str]], int], argv: list[str], env: dict[str, str], cwd: str,
               fds: list[int]) -> None:
    """Become the run: raises SystemExit with its exit code, so this process ends as an
    interpreter does (the server's loop has nothing to undo on the way out)."""
    with contextlib.suppress(OSError):  # the server may have set it first
        os.setpgid(0, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [sys.argv[0], *argv]
    code: Any = 1
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    except BaseException:
        traceback.print_exc()
    sys.exit(code)


class ForkedRun:
    """A run forked by the server, driven as `subprocess.Popen` drives a process:
    `pid` (its process group too), `communicate`, `returncode`."""

    def __init__(self, conn: socket.socket, pid: int, stdout: int, stderr: int) -> None:
        self.pid = pid
        self.returncode = -1  # until `communicate` has heard the server's wait for it
        self._conn = conn
        self._pipes = {stdout: bytearray(), stderr: bytearray()}  # in that order
        self._selector = selectors.DefaultSelector()
        for fd in self._pipes:
            self._selector.register(fd, selectors.EVENT_READ)
        self._selector.register(conn, selectors.EVENT_READ)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Read both pipes to their end and the exit code; TimeoutExpired past `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._selector.get_map():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"forked run {self.pid}", timeout or 0.0)
            for key, _ in self._selector.select(left):
                if key.fileobj is self._conn:
                    self._selector.unregister(self._conn)
                    with contextlib.suppress(OSError):  # the server gone: the exit code unknown (-1)
                        message = self._conn.recv(MAX_MESSAGE)
                        self.returncode = int(json.loads(message)["returncode"]) if message else -1
                    self._conn.close()
                    continue
                chunk = os.read(key.fd, 1 << 16)
                if chunk:
                    self._pipes[key.fd] += chunk
                else:
                    self._selector.unregister(key.fd)
                    os.close(key.fd)
        self._selector.close()
        out, err = (output.decode(errors="replace") for output in self._pipes.values())
        return out, err


def fork_run(argv: list[str], env: dict[str, str], cwd: str) -> ForkedRun | None:
    """Ask the server named by KVSTORE_ENGINE_FORK to fork this run; None where there is
    no server or it refuses (the caller starts a process of its own)."""
    path = os.environ.get(SOCKET_ENV)
    if not path:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(HANDSHAKE_TIMEOUT_S)  # a stopped or busy server: the run starts cold
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        conn.connect(path)
        socket.send_fds(conn, [json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()], [out_w, err_w])
        reply = json.loads(conn.recv(MAX_MESSAGE) or b"{}")
    except (OSError, ValueError):
        reply = {}
    finally:
        os.close(out_w)
        os.close(err_w)
    if "pid" not in reply:
        for fd in (out_r, err_r):
            os.close(fd)
        conn.close()
        return None
    return ForkedRun(conn, int(reply["pid"]), out_r, err_r)

