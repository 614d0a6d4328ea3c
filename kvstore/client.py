"""Client of the per-host service: connect (or start it), then lookup/get/put.

A client is used by one thread at a time (a connection carries one request at a
time); an engine worker keeps one for loads and one for saves. Every request has
a deadline: a service that does not answer in time costs a miss, never a hang,
and the connection is dropped so a late answer cannot be taken for the next one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from kvstore.aligned import AlignedBuffer
from kvstore.config import StoreConfig, dump_config
from kvstore.errors import KVStoreError
from kvstore.service import Hello

SPAWN_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 5.0


class ServiceUnavailable(KVStoreError):
    """The service did not answer (not running, crashed, or past the deadline)."""


def open_socket(path: str, timeout_s: float = CONNECT_TIMEOUT_S) -> Connection:
    """Connect with a deadline: a Unix connect() blocks while the listener's backlog
    is full, which is what a hung service looks like."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(path)
    except TimeoutError:
        sock.close()
        raise ServiceUnavailable(f"kvstore service at {path} accepts no connection") from None
    except OSError:
        sock.close()
        raise
    sock.settimeout(None)
    return Connection(sock.detach())


def connect(config: StoreConfig) -> Connection:
    """Connect to the service at config.service.socket, starting it if allowed."""
    path = config.service.socket
    with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
        return open_socket(path)
    if not config.service.spawn:
        raise ServiceUnavailable(f"no kvstore service at {path} (service.spawn is false: start it "
                                 f"with `kvstore serve --config ...`)")
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one spawner per socket; the others then connect
        with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
            return open_socket(path)
        return _spawn(config)


# Starts the service and exits at once, so the service is no descendant of the
# engine: vLLM kills its workers' whole process trees on shutdown, and the
# service (with its DRAM tier) must outlive the engine that happened to start it.
_LAUNCHER = ("import subprocess, sys\n"
             "log = open(sys.argv[1], 'ab')\n"
             "p = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=log, stderr=log,"
             " start_new_session=True)\n"
             "print(p.pid)")


def _spawn(config: StoreConfig) -> Connection:
    path = config.service.socket
    log_path = path + ".log"
    service = [sys.executable, "-m", "kvstore.cli", "serve", "--config-json",
               json.dumps(dump_config(config))]
    launched = subprocess.run([sys.executable, "-c", _LAUNCHER, log_path, *service],
                              capture_output=True, text=True, timeout=30, check=True)
    pid = int(launched.stdout)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while time.monotonic() < deadline:
        if not _alive(pid):
            raise KVStoreError(f"kvstore service failed to start: {_last_line(log_path)}")
        with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
            return open_socket(path)
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


class StoreClient:
    """One connection plus, for data clients, a staging window of whole chunks.

    With `chunk_bytes` None the client can only `lookup` and `info` (a scheduler).
    `get(keys, slots)` fills window slot slots[i] (`slot(n)` is its view) with chunk
    keys[i]; `put(keys, slots)` stores chunk keys[i] from slot slots[i].
    `timeout_s`: each request's deadline (None: 2 x io.timeout_s).
    """

    def __init__(self, config: StoreConfig, chunk_bytes: int | None = None, *,
                 namespace: bytes = bytes(16), dtype: str = "uint8",
                 shape: tuple[int, ...] = (), timeout_s: float | None = None) -> None:
        self.config = config
        self.chunk_bytes = chunk_bytes
        self.timeout_s = 2 * config.io.timeout_s if timeout_s is None else timeout_s
        self.window: AlignedBuffer | None = None
        self.slots = 0
        if chunk_bytes is not None:
            self.slots = max(1, config.service.staging // chunk_bytes)
            name = f"kvstore-window-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.window = AlignedBuffer(self.slots * chunk_bytes, name)
        self._hello = Hello(config=dump_config(config), chunk_bytes=chunk_bytes,
                            window=os.path.basename(self.window.shm_path or "") if self.window else None,
                            window_bytes=self.window.nbytes if self.window else 0,
                            namespace=namespace, dtype=dtype, shape=shape)
        self._conn: Connection | None = None
        try:
            self._connect()
        finally:
            if self.window is not None:
                self.window.unlink()  # the service mapped it (or failed): no file left behind

    def _connect(self) -> None:
        conn = connect(self.config)
        self._conn = conn
        self._request("hello", self._hello)

    def slot(self, index: int) -> memoryview:
        assert self.window is not None and self.chunk_bytes is not None
        start = index * self.chunk_bytes
        return self.window.view[start : start + self.chunk_bytes]

    def residency(self, keys: Sequence[bytes], prefetch: bool = False) -> tuple[int, int, bool]:
        """(leading chunks present, of those already in DRAM, whether a promotion of that
        run is queued or running). `prefetch` starts moving the run up to DRAM (its disk
        part read, the rest touched): the hint API, for keys a request will want."""
        stored, resident, pending = self._request("residency", list(keys), prefetch)
        return int(stored), int(resident), bool(pending)

    def count(self, counters: dict[str, float]) -> None:
        """Add to the service's counters (shown by `kvstore info` and Prometheus)."""
        self._request("count", dict(counters))

    def get(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[bool]:
        return list(self._request("get", list(keys), list(slots)))

    def put(self, keys: Sequence[bytes], slots: Sequence[int],
            parent: bytes | None = None) -> list[bool]:
        return list(self._request("put", list(keys), list(slots), parent))

    def info(self) -> dict[str, Any]:
        return dict(self._request("info"))

    def shutdown(self, timeout_s: float = 300.0) -> None:
        """Ask the service to drain, checkpoint and exit; return once it has (its socket
        is gone), so a successor can take the tiers at once."""
        self._request("shutdown")
        self.close()
        deadline = time.monotonic() + timeout_s
        while os.path.exists(self.config.service.socket):
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"kvstore service at {self.config.service.socket} did not "
                                         f"exit within {timeout_s:.0f} s")
            time.sleep(0.02)

    def close(self) -> None:
        self.disconnect()
        if self.window is not None:
            self.window.close()
            self.window = None

    def _request(self, op: str, *args: Any) -> Any:
        if self._conn is None:
            raise ServiceUnavailable("connection to the kvstore service was dropped")
        try:
            self._conn.send((op, *args))
            if not self._conn.poll(self.timeout_s):
                raise ServiceUnavailable(f"kvstore service gave no answer to '{op}' "
                                         f"in {self.timeout_s:g} s")
            status, value = self._conn.recv()
        except (OSError, EOFError) as exc:
            self.disconnect()
            raise ServiceUnavailable(f"kvstore service connection lost during '{op}': {exc}") from exc
        except ServiceUnavailable:
            self.disconnect()
            raise
        if status != "ok":
            raise KVStoreError(f"kvstore service: {value}")
        return value

    def disconnect(self) -> None:
        """Close the connection; the window stays mapped for copies still in flight."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def attach(config: StoreConfig) -> StoreClient:
    """A lookup-only client of a running service; never starts one."""
    service = dataclasses.replace(config.service, spawn=False)
    return StoreClient(dataclasses.replace(config, service=service))


def service_info(config: StoreConfig) -> dict[str, Any] | None:
    """The running service's `info` (tiers, devices, counters); None when none answers."""
    try:
        client = attach(config)
    except ServiceUnavailable:
        return None
    try:
        return client.info()
    finally:
        client.close()


def stop_service(config: StoreConfig) -> bool:
    """Ask the service at config.service.socket to drain and exit; False if none runs."""
    try:
        attach(config).shutdown()
    except ServiceUnavailable:
        return False
    return True
