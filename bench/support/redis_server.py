"""Throwaway redis-servers on loopback ports, in a directory of their own, for the cluster
tests and `python -m bench.lab cluster_bench`: one instance, or a Redis Cluster of several;
persistence off (the index is a hint, nothing in it needs to survive), paused, resumed
and killed with signals, stopped even when paused.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.support.processes import free_port, pause, port_free, resume


def redis_server_unavailable(cluster: bool = False) -> str | None:
    """Why no redis-server (and, for a `cluster`, no redis-cli) can be run here, or None."""
    for program in ("redis-server", "redis-cli") if cluster else ("redis-server",):
        if shutil.which(program) is None:
            return f"{program} is not installed (scripts/setup.sh installs it with apt, as root)"
    return None


class RedisServer:
    """One redis-server on loopback. `args`: more of its options (a password, ACL users);
    `tls`: its port speaks TLS only (give the `--tls-*` files in `args`)."""

    def __init__(self, workdir: Path, args: Sequence[str] = (), tls: bool = False) -> None:
        self.workdir = workdir
        self.args = list(args)
        self.tls = tls
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start on a free port (a new one each time: another test may take the old one)."""
        for _ in range(5):
            if self._launch(free_port()):
                return
        raise RuntimeError(f"redis-server did not start (see {self.workdir})")

    def restart(self) -> None:
        """Stop and start again on the same port (the clients' URL stays valid)."""
        self.stop()
        if not self._launch(self.port):
            raise RuntimeError(f"redis-server did not come back (see {self.workdir})")

    def _launch(self, port: int) -> bool:
        self.port = port
        ports = ["--port", "0", "--tls-port", str(port)] if self.tls else ["--port", str(port)]
        self.process = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", *ports, "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir),
             "--logfile", str(self.workdir / f"redis-{port}.log"), *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30  # a loaded 2-core host starts six nodes slowly
        while time.monotonic() < deadline and self.process.poll() is None:
            if self.answers(self.port, self.tls):
                return True
            time.sleep(0.02)
        self.stop()
        return False

    @staticmethod
    def answers(port: int, tls: bool = False) -> bool:
        """It listens (TLS) or answers a PING (one that asks for a password first counts)."""
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                if tls:
                    return True
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def pause(self) -> None:
        assert self.process is not None
        pause(self.process.pid)

    def resume(self) -> None:
        assert self.process is not None
        resume(self.process.pid)

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


class RedisClusterServers:
    """A Redis Cluster on loopback: `masters` masters with a replica each, in a directory of
    its own, as docs/cluster.md's recipe starts one. The node timeout is short (a master
    that stops answering is failed over within a few seconds) and full coverage is not
    required (the other shards serve while one is failed over)."""

    def __init__(self, workdir: Path, masters: int = 3, node_timeout_ms: int = 1000) -> None:
        self.workdir = workdir
        self.masters = masters
        self.node_timeout_ms = node_timeout_ms
        self.processes: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """A `redis+cluster://` URL listing every node (the client needs only one that answers)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.processes)

    def start(self) -> None:
        """Start the nodes and join them. The join is tried on fresh nodes once more where
        `redis-cli --cluster create` has not finished in a minute (seen once, in a CI run
        on a loaded 2-core host); a second failure says what the nodes logged."""
        for tries_left in (1, 0):
            try:
                self._start_nodes()
                subprocess.run(["redis-cli", "--cluster", "create",
                                *(f"127.0.0.1:{port}" for port in self.processes),
                                "--cluster-replicas", "1", "--cluster-yes"],
                               check=True, timeout=60, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                self.wait_until(lambda: all(self.serving(port) for port in self.processes), 30, "the cluster")
                return
            except subprocess.TimeoutExpired:
                logs = self._log_tails()
                self.stop()
                self.processes.clear()
                if not tries_left:
                    raise RuntimeError(f"redis-cli --cluster create did not finish twice; the nodes "
                                       f"logged:\n{logs}") from None
            except BaseException:
                self.stop()
                raise

    def _start_nodes(self) -> None:
        for port in _cluster_ports(2 * self.masters):
            self._launch(port)
        deadline = time.monotonic() + 30  # a loaded 2-core host starts six nodes slowly
        while not all(RedisServer.answers(port) for port in self.processes):
            for port, process in list(self.processes.items()):
                if process.poll() is not None:  # its port (or bus port) was taken since: another
                    del self.processes[port]
                    self._launch(_cluster_ports(1)[0])  # never a running node's: it is bound
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server nodes did not start (see {self.workdir})")
            time.sleep(0.05)

    def _log_tails(self, lines: int = 8) -> str:
        """The last lines each node logged."""
        tails = []
        for port in self.processes:
            path = self.workdir / f"redis-{port}.log"
            text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
            tails.append(f"{port}: " + "\n  ".join(text))
        return "\n".join(tails)

    def _launch(self, port: int) -> None:
        self.processes[port] = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--cluster-enabled", "yes",
             "--cluster-config-file", f"nodes-{port}.conf",
             "--cluster-node-timeout", str(self.node_timeout_ms),
             "--cluster-require-full-coverage", "no", "--cluster-replica-validity-factor", "0",
             "--logfile", str(self.workdir / f"redis-{port}.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def serving(self, port: int) -> bool:
        """The node at `port` says the cluster is up and every slot is assigned."""
        info = self._ask(port, "CLUSTER", "INFO")
        return "cluster_state:ok" in info and "cluster_slots_assigned:16384" in info

    def primaries(self, port: int) -> set[int]:
        """The ports of the masters serving slots, as the node at `port` sees them."""
        with self._client(port) as client:
            slots = client.execute_command("CLUSTER", "SLOTS")
        return {int(row[2][1]) for row in slots}

    def live(self) -> int:
        """The port of a node still running."""
        return next(port for port, process in self.processes.items() if process.poll() is None)

    def primary_of(self, key: bytes) -> int:
        """The port of the master serving `key`'s slot now."""
        with self._client(self.live()) as client:
            slot = client.execute_command("CLUSTER", "KEYSLOT", key)
            slots = client.execute_command("CLUSTER", "SLOTS")
        for start, end, master, *_ in slots:
            if start <= slot <= end:
                return int(master[1])
        raise LookupError(f"no master serves slot {slot}")

    def move_slot(self, key: bytes, to: int, midway: Callable[[], None] = lambda: None) -> None:
        """Move `key`'s slot to the master at port `to`, as `redis-cli --cluster reshard` does:
        mark it migrating and importing, MIGRATE its keys, call `midway` (clients asking the
        old master now get ASK), then assign it to `to` everywhere (they get MOVED)."""
        source = self.primary_of(key)
        with self._client(source) as old, self._client(to) as new:
            slot = old.execute_command("CLUSTER", "KEYSLOT", key)
            old_id, new_id = old.execute_command("CLUSTER", "MYID"), new.execute_command("CLUSTER", "MYID")
            new.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", old_id)
            old.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", new_id)
            keys = old.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
            old.execute_command("MIGRATE", "127.0.0.1", to, "", 0, 5000, "KEYS", *keys)
            midway()
            for port in {source, to} | self.primaries(to):
                with self._client(port) as node:
                    node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", new_id)

    def replicas(self, port: int) -> list[int]:
        """The ports of the replicas of the master at `port`."""
        with self._client(port) as client:
            me = client.execute_command("CLUSTER", "MYID")
            me = me.decode() if isinstance(me, bytes) else me
            nodes = client.execute_command("CLUSTER", "REPLICAS", me)
        return [int(line.split()[1].split("@")[0].rpartition(":")[2])
                for line in (n.decode() if isinstance(n, bytes) else n for n in nodes)]

    def kill(self, port: int) -> None:
        """SIGKILL one node (no clean stop: its replica must notice and take over)."""
        self.processes[port].kill()
        self.processes[port].wait()

    def pause(self, port: int) -> None:
        """SIGSTOP one node: it accepts connections and answers nothing (a hung master)."""
        pause(self.processes[port].pid)

    def resume(self, port: int) -> None:
        resume(self.processes[port].pid)

    def wait_until(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(OSError, redis_errors()):
                if condition():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not ready in {timeout_s} s (see {self.workdir})")
            time.sleep(0.1)

    def _client(self, port: int) -> Any:
        import redis

        return redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2)

    def _ask(self, port: int, *command: str) -> str:
        with self._client(port) as client:
            answer = client.execute_command(*command)
        return answer.decode() if isinstance(answer, bytes) else str(answer)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()  # SIGKILL ends a stopped process too
            process.wait()


def redis_errors() -> type[Exception]:
    import redis

    return redis.RedisError


def _cluster_ports(count: int) -> list[int]:
    """Free loopback ports whose cluster bus ports (each + 10000) are free too."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port + 10000 < 65536 and port not in ports and port_free(port + 10000):
            ports.append(port)
    return ports
