"""The client's connection to the per-host service: reach it (or start it), then ask it
one request at a time, each under a deadline.

Before it says anything, a connection checks that the socket's directory is private and
that the process listening is this user's (or one the config trusts). A service that
does not answer in time costs the caller a ServiceUnavailable, never a hang, and the
connection is dropped so a late answer cannot be taken for the next request's.
The typed requests are client.py's (StoreClient); this module only carries them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import msgspec

from kvstore.config.runtime import directory_problem, ensure_private_directory, open_private
from kvstore.config.store import StoreConfig, dump_config
from kvstore.format.checksum import PIECE
from kvstore.format.errors import ConfigError, KVStoreError
from kvstore.io.streaming import with_streaming
from kvstore.service import protocol as P

SPAWN_TIMEOUT_S = 60.0


class ServiceUnavailable(KVStoreError):
    """The service did not answer (not running, crashed, or past the deadline)."""


def open_channel(config: StoreConfig) -> P.Channel:
    """Connect and check who listens. A service that hangs stops accepting: once its
    listener's backlog is full, a blocking connect() would wait for it forever, so the
    connect does not block: a Unix socket's connects at once or fails at once (EAGAIN),
    a ServiceUnavailable, never an OSError for the engine's thread."""
    path = config.service.socket
    directory = os.path.dirname(os.path.abspath(path))
    problem = directory_problem(directory, config.service.allowed_uids)  # ours or a trusted user's
    if problem is not None and problem != "does not exist":
        raise ConfigError("service.socket", path, f"its directory {directory} {problem}: refusing "
                                                  "to talk to whatever listens there")
    sock = _connected(path)
    _, uid, _ = P.peer_credentials(sock)
    if uid != os.geteuid() and uid not in config.service.allowed_uids:
        sock.close()
        raise KVStoreError(f"the process listening at {path} runs as uid {uid}, not this user "
                           f"({os.geteuid()}): refusing it (service.allowed_uids lists trusted users)")
    return P.Channel(sock)


def listening(config: StoreConfig) -> bool:
    """Whether anything listens at config.service.socket (a full backlog counts: it is
    there, hung); the connection made to ask closes unused."""
    try:
        _connected(config.service.socket).close()
    except ServiceUnavailable:
        return True
    except OSError:  # no socket there, or no one listening at it
        return False
    return True


def _connected(path: str) -> socket.socket:
    """A socket connected to `path` without blocking (the caller's channel sets its own
    deadlines): a Unix socket connects at once or fails at once; a full backlog (EAGAIN)
    is a ServiceUnavailable, any other failure its OSError."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        sock.connect(path)
    except BlockingIOError:
        sock.close()
        raise ServiceUnavailable(f"kvstore service at {path} accepts no connection (its backlog "
                                 "is full: it hangs)") from None
    except OSError:
        sock.close()
        raise
    return sock


def connect(config: StoreConfig) -> P.Channel:
    """Connect to the service at config.service.socket, starting it if allowed."""
    path = config.service.socket
    with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
        return open_channel(config)
    if not config.service.spawn:
        raise ServiceUnavailable(f"no kvstore service at {path} (service.spawn is false: start it "
                                 f"with `kvstore serve --config ...`)")
    ensure_private_directory(path)
    lock = open_private(path + ".spawn", os.O_RDWR)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one spawner per socket; the others then connect
        with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
            return open_channel(config)
        return _spawn(config)
    finally:
        os.close(lock)


# Starts the service and exits at once, so the service is no descendant of the
# engine: vLLM kills its workers' whole process trees on shutdown, and the
# service (with its DRAM tier) must outlive the engine that happened to start it.
# The service starts with SIGHUP ignored (inherited through exec) until `kvstore serve`
# catches it (cli.main): a reload asked for while it starts cannot end it.
_LAUNCHER = ("import os, signal, subprocess, sys\n"
             "signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
             "log = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW"
             " | os.O_CLOEXEC, 0o600)\n"
             "p = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=log, stderr=log,"
             " start_new_session=True)\n"
             "print(p.pid)")


def _spawn(config: StoreConfig) -> P.Channel:
    """Start a service; its config goes through a 0600 file in the private directory
    (not the command line, which every user can read in /proc). Its copies into DRAM slots
    (a put's, hashed PIECE bytes at a time) stream past the cache (io/streaming.py)."""
    path = config.service.socket
    log_path, config_path = path + ".log", path + ".json"
    fd = open_private(config_path, os.O_WRONLY | os.O_TRUNC)
    with os.fdopen(fd, "w") as f:
        json.dump(dump_config(config), f)
    service = [sys.executable, "-m", "kvstore.cli", "serve", "--config", config_path]
    launched = subprocess.run([sys.executable, "-c", _LAUNCHER, log_path, *service], capture_output=True,
                              text=True, timeout=30, env=with_streaming(os.environ, PIECE))
    if launched.returncode != 0:  # killed before it started the service: try again later
        raise ServiceUnavailable(f"the launcher of a kvstore service at {path} exited with "
                                 f"{launched.returncode}: {launched.stderr.strip()[-300:]}")
    pid = int(launched.stdout)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while time.monotonic() < deadline:
        if not _alive(pid):
            raise KVStoreError(f"kvstore service failed to start: {_last_line(log_path)}")
        with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
            return open_channel(config)
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    raise ServiceUnavailable(f"kvstore service at {path} did not come up in {SPAWN_TIMEOUT_S:.0f} s "
                             f"(log: {log_path})")


def _alive(pid: int) -> bool:
    """True while `pid` runs (an exited orphan may linger as a zombie until reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _last_line(log_path: str) -> str:
    with open(log_path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1] if lines else f"no output (see {log_path})"


class Connection:
    """One connection to the service carrying one request at a time, each under a deadline.

    It exists apart from the typed requests (StoreClient) so that the rule which keeps a
    late answer from being read as the next request's holds for every request in one
    place. Invariants: a request either returns its reply's value, raises KVStoreError
    for an error reply (the service refused this request; the connection stays), or
    raises ServiceUnavailable; after a request that timed out or lost the frame stream,
    every request is ServiceUnavailable at once (a late answer is never read as another's).
    A connection the service ended (EOF, a socket error) is closed then; one that only
    timed out, or whose answer was not a frame of this protocol, stays open until its owner
    closes it: the service still holds the pins it took for this client, and a copy out of
    the tier may still be reading under them (closed, the pins would go, and another
    client's put could reuse the slot mid-copy).
    `timeout_s` is a request's deadline unless the request names its own.
    """

    def __init__(self, channel: P.Channel, timeout_s: float) -> None:
        self._channel: P.Channel | None = channel
        self._ended = ""  # why no request goes out any more (a timed-out one)
        self.timeout_s = timeout_s

    def request(self, message: msgspec.Struct, timeout_s: float | None = None) -> Any:
        name = type(message).__name__
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if self._channel is None or self._ended:
            raise ServiceUnavailable(self._ended or "connection to the kvstore service was dropped")
        try:
            self._channel.send(message)
            reply = self._channel.recv(P.REPLY, timeout_s)
        except TimeoutError:
            self._ended = f"kvstore service gave no answer to '{name}' in {timeout_s:g} s"
            raise ServiceUnavailable(self._ended) from None
        except P.ProtocolError as exc:  # a live service's frame lost: as a timeout, the owner closes
            self._ended = f"kvstore service's answer to '{name}' is not of this protocol: {exc}"
            raise ServiceUnavailable(self._ended) from exc
        except (OSError, EOFError) as exc:
            self.close()
            raise ServiceUnavailable(f"kvstore service connection lost during '{name}': {exc}") from exc
        if not reply.ok:
            raise KVStoreError(f"kvstore service: {reply.error}")
        return reply.value

    def take_fd(self) -> int | None:
        """A descriptor the last reply carried (the hello's window and tier), None if none."""
        return self._channel.take_fd() if self._channel is not None else None

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
