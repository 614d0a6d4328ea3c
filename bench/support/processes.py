"""Child processes of the harness: a free loopback port, a command started in a process
group of its own and stopped with everything it started, waiting for one to come up, and
what a process and its group use (CPU time, listening sockets), read from /proc.

One copy of each for every server the harness runs (vLLM's, SGLang's, LMCache's MP
server, redis-server, vllm-router, the kvstore service) and for the tests.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: children start here
START_TIMEOUT_S = 300.0


def free_port() -> int:
    """A loopback TCP port nobody holds now, below the kernel's ephemeral range (and with
    its +10000, a Redis Cluster node's bus port, below it too) where there is room: a port
    the kernel picks itself for a client's connect or a server's port 0 could be handed to
    any process of the host between this pick and the server's bind, one it never picks
    on its own only to another explicit pick. The kernel's pick where there is no room."""
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    top = ephemeral - 10_000
    for _ in range(64 if top - _LOWEST_PORT >= 1_000 else 0):
        port = random.randrange(_LOWEST_PORT, top)
        if port not in _HANDED_OUT and port_free(port):
            _HANDED_OUT.add(port)  # two picks before either is bound (a router's pair) differ
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_LOWEST_PORT = 10_240  # above the well-known and most registered servers' ports
_HANDED_OUT: set[int] = set()


def port_free(port: int) -> bool:
    """Whether a listener could bind `port` on loopback now (no SO_REUSEADDR: a port in
    TIME_WAIT counts as taken)."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def process_cpu(pid: int) -> float:
    """CPU seconds of a process so far, all its threads (those gone too), to the nanosecond:
    the process's CPU-time clock (clock_getcpuclockid). /proc/PID/stat counts in clock ticks
    (10 ms), as coarse as a whole 0.5 GiB load's CPU is large."""
    return time.clock_gettime(((~pid) << 3) | 2)  # Linux's MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> str | None:
    """Wait until `url`/health answers 200: None, or why not (the process exited, or the
    deadline passed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return f"exited with {process.returncode}"
        with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=2) as reply:
            if reply.status == 200:
                return None
        time.sleep(0.3)
    return f"not up within {timeout_s:.0f} s"



def pause(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP `pid` and wait until every thread of it has stopped: kill() returns before a
    thread running on another CPU has stopped, and a request sent in that window would be
    answered by a process that is meant to be hung."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not _all_stopped(pid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} not stopped {timeout_s:g} s after SIGSTOP")
        time.sleep(0.01)


def resume(pid: int) -> None:
    """SIGCONT `pid` (gone already: nothing to resume)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    """The process stopped (a hung server: it accepts and answers nothing) for the duration."""
    try:
        pause(pid)
        yield
    finally:
        resume(pid)


@contextlib.contextmanager
def paused_group(pgid: int, timeout_s: float = 10.0) -> Iterator[None]:
    """Every process of the group stopped for the duration: an idle server that polls its
    queues (vLLM's workers spin on theirs) takes no core from the one being timed."""
    try:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while not all(_all_stopped(pid) for pid in _group_members(pgid)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"process group {pgid} not stopped {timeout_s:g} s after SIGSTOP")
            time.sleep(0.01)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGCONT)


def _group_members(pgid: int) -> list[int]:
    """The processes of process group `pgid` (/proc/PID/stat's pgrp)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                members.append(int(stat.parent.name))
    return members


def _all_stopped(pid: int) -> bool:
    """Every thread of `pid` is in a stop (T, or t under a tracer), or has exited."""
    tasks = Path(f"/proc/{pid}/task")
    try:
        threads = list(tasks.iterdir())
    except FileNotFoundError:  # the process is gone
        return True
    for task in threads:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            if (task / "stat").read_text().rsplit(")", 1)[1].split()[0] not in "TtZX":
                return False
    return True


def start_group(command: list[str], log_path: str | Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """`command` in a process group of its own (so stop_group reaches everything it starts),
    its output appended to `log_path`."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=ROOT, start_new_session=True)



def stop_group(process: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    """SIGTERM to the process's whole group, SIGKILL to what is left after `timeout_s`.
    It waits for the whole group, not just its leader: vLLM's engine leaves its shared-memory
    queues (/dev/shm/psm_*) to Python's resource tracker, which outlives the server by a
    moment to unlink them, and a SIGKILL then would leave them behind."""
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        deadline = time.monotonic() + wait_s
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=wait_s)
        while _group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _group_alive(process.pid):
            break



def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True



def wait_for(ready: Callable[[], bool], process: subprocess.Popen[bytes], what: str, log: Path,
             timeout_s: float = START_TIMEOUT_S) -> None:
    """Poll `ready()` until true; the process's exit or the deadline is an error naming
    `what`, with its log's tail."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        problem = (f"exited with {process.returncode}" if process.poll() is not None
                   else f"not up within {timeout_s:.0f} s" if time.monotonic() > deadline else None)
        if problem:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"{what} {problem}:\n{tail}")
        time.sleep(0.3)



def tcp_listeners(group: int) -> set[tuple[str, int]]:
    """The TCP addresses (IP, port) the processes of process group `group` listen on, read
    from /proc (the sockets each holds, matched with the kernel's TCP tables)."""
    inodes = set()
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text() if proc.name.isdigit() else ""
            if not stat or int(stat.rpartition(")")[2].split()[2]) != group:  # its process group
                continue
            fds = list((proc / "fd").iterdir())
        except OSError:  # gone, or not ours
            continue
        for fd in fds:
            with contextlib.suppress(OSError):  # closed meanwhile
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)  # the kernel's words, each in host (little-endian) order
                ip = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add((socket.inet_ntop(family, ip), int(port, 16)))
    return found
