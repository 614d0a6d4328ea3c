"""`kvstore serve`: one process per host owns the tiers; engines talk to it over a socket.

Why a service: vLLM runs its scheduler and each tensor-parallel worker in separate
processes, and several engines may share a host. The scheduler must answer "how
much of this prompt is stored?" about chunks that workers wrote, and two processes
must never drive one slot map. So one process owns the DRAM slab and the disks
(each path flock'ed), and clients send it small requests over a Unix socket.

Data never crosses the socket. Each client maps a shared-memory staging window
(a file under /dev/shm) that the service maps too: a get fills the client's
window slots (from DRAM by memcpy, from disk by O_DIRECT reads), a put reads
them. A worker's load or save is thus a plain copy between its KV tensors and
that window.

Requests (tuples, pickled by multiprocessing.connection):
  ("hello", Hello)            -> None; maps the window, creates the store on first use
  ("residency", keys, prefetch) -> (leading chunks present, of those in DRAM, promotion
                                 of that run queued or running); with prefetch, that run
                                 is promoted to DRAM in the background
  ("count", {name: amount})   -> None; adds to the service's counters
  ("get", keys, slots)        -> [bool]: window slot slots[i] now holds chunk keys[i]
  ("put", keys, slots, parent)-> [bool]: chunk keys[i] (in window slot slots[i]) is stored
  ("info",)                   -> store.info()
  ("shutdown",)               -> None; the service drains, checkpoints and exits
Every reply is ("ok", value) or ("error", message).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from kvstore.aligned import AlignedBuffer
from kvstore.config import StoreConfig, dump_config
from kvstore.errors import ConfigError, DeviceError, KVStoreError
from kvstore.nvmeof.tier import namespace_plans
from kvstore.store import TieredStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hello:
    """What a client tells the service when it connects.

    `chunk_bytes` is None for a lookup-only client (an engine's scheduler), which
    has no window. The first client with a chunk size fixes the store's slot size.
    """

    config: dict[str, Any]
    chunk_bytes: int | None = None
    window: str | None = None  # name of the client's staging file under /dev/shm
    window_bytes: int = 0
    namespace: bytes = bytes(16)
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()


def check_paths_usable(config: StoreConfig) -> None:
    """Fail at start-up, naming the field, when a disk path cannot be written.

    The store itself is created when the first worker says its chunk size, which
    is too late for a clear start-up error.
    """
    if config.nvmeof is not None:
        try:
            namespace_plans(config.nvmeof)
        except DeviceError as exc:
            raise ConfigError("tiers.nvmeof", exc.path, str(exc)) from None
    for i, disk in enumerate(config.disk):
        field, path = f"tiers.disk[{i}].path", disk.path
        if os.path.exists(path):
            if not (os.path.isdir(path) or stat.S_ISBLK(os.stat(path).st_mode)):
                raise ConfigError(field, path, "must be a directory or a block device")
            if not os.access(path, os.W_OK):
                raise ConfigError(field, path, "not writable by this user")
            continue
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise ConfigError(field, path, "does not exist, and its parent is not a directory")
        if not os.access(parent, os.W_OK):
            raise ConfigError(field, path, "does not exist, and its parent is not writable")


def _unpin_from_parent() -> None:
    """Run on every CPU the host allows.

    A service started on demand by an engine worker inherits that worker's CPU
    mask, and vLLM pins each CPU worker to its own cores, where it busy-polls: the
    service then got a fraction of one core and answered nothing within deadlines.
    """
    cpus = set(range(os.cpu_count() or 1))
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:  # a cpuset may forbid some CPUs: keep what we have
        log.info("kept the inherited CPU mask %s (%s)", sorted(os.sched_getaffinity(0)), exc)


class StoreService:
    """Accepts clients on a Unix socket; one thread per client; one TieredStore."""

    def __init__(self, config: StoreConfig) -> None:
        check_paths_usable(config)
        _unpin_from_parent()
        # Each client request already copies on its own thread; torch's intra-op pool
        # on top would add spinning threads on cores the engine's processes busy-poll.
        # (The minutes-long copies once seen here came from the inherited CPU mask,
        # fixed above; this setting was not measured on its own.)
        import torch

        torch.set_num_threads(1)
        self.config = config
        self.socket_path = config.service.socket
        self.store: TieredStore | None = None
        # One prefetch at a time, in lookup order: its wave bounds the bytes in flight,
        # and a get for the same chunks never waits on it (it reads them itself).
        self._prefetcher = ThreadPoolExecutor(1, "kvstore-prefetch")
        self._prefetch_queued: set[tuple[bytes, ...]] = set()  # runs waiting for the prefetcher
        self._store_lock = threading.Lock()
        self._stopping = threading.Event()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)  # a stale socket of a dead service (callers hold the lock)
        self._listener = Listener(self.socket_path, family="AF_UNIX", backlog=64)
        os.chmod(self.socket_path, 0o600)
        if config.service.metrics_port:
            from kvstore.metrics import serve_metrics

            serve_metrics(config.service.metrics_port, lambda: self.store)

    def serve_forever(self) -> None:
        """Serve until a client sends shutdown or the process gets SIGTERM/SIGINT."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())
        log.warning("kvstore service listening on %s", self.socket_path)
        try:
            while not self._stopping.is_set():
                conn = self._listener.accept()
                if self._stopping.is_set():
                    conn.close()
                    break
                threading.Thread(target=self._serve_client, args=(conn,), daemon=True).start()
        finally:
            self._close()

    def stop(self) -> None:
        """Make serve_forever return: closing a listener does not wake a blocked
        accept() on Linux, so connect once to wake it after setting the flag."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        with contextlib.suppress(OSError):
            Client(self.socket_path, family="AF_UNIX").close()

    def _close(self) -> None:
        """Store first, socket last: while the socket exists the tiers are still held,
        so whoever waits for it to vanish (`kvstore stop`) can start a successor."""
        self._prefetcher.shutdown(wait=True, cancel_futures=True)
        with self._store_lock:
            if self.store is not None:
                self.store.close()
                self.store = None
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

    # -- one client ------------------------------------------------------------------

    def _serve_client(self, conn: Connection) -> None:
        window: AlignedBuffer | None = None
        try:
            while True:
                try:
                    request = conn.recv()
                except (EOFError, OSError):
                    return
                op = request[0]
                try:
                    if op == "hello":
                        window = self._hello(request[1])
                        reply: Any = None
                    elif op == "shutdown":
                        conn.send(("ok", None))
                        self.stop()
                        return
                    else:
                        reply = self._handle(op, request[1:], window)
                except KVStoreError as exc:
                    reply, status = str(exc), "error"
                except Exception as exc:  # a bug must not take the whole service down
                    log.exception("request %s failed", op)
                    reply, status = f"{type(exc).__name__}: {exc}", "error"
                else:
                    status = "ok"
                try:
                    conn.send((status, reply))
                except OSError:
                    log.warning("a client left before its '%s' was answered (past its deadline?)", op)
                    return
        finally:
            if window is not None:
                window.close()
            conn.close()

    def _hello(self, hello: Hello) -> AlignedBuffer | None:
        ours, theirs = dump_config(self.config), dict(hello.config)
        ours.pop("service")
        theirs.pop("service", None)
        if ours != theirs:
            raise ConfigError("service.socket", self.socket_path,
                              f"a kvstore service with another config listens there "
                              f"(its config: {ours}); stop it (kvstore stop) or use another socket")
        if hello.chunk_bytes is None:
            return None
        with self._store_lock:
            if self.store is None:
                self.store = TieredStore(self.config, hello.chunk_bytes, namespace=hello.namespace,
                                         dtype=hello.dtype, shape=hello.shape)
            elif self.store.chunk_bytes != hello.chunk_bytes:
                raise ConfigError("service.socket", self.socket_path,
                                  f"this service stores chunks of {self.store.chunk_bytes} bytes, "
                                  f"this engine's are {hello.chunk_bytes}: give it its own socket")
        if hello.window is None or hello.window_bytes < hello.chunk_bytes:
            raise KVStoreError("a client with a chunk size must bring a staging window")
        return AlignedBuffer(hello.window_bytes, hello.window, create=False)

    def _prefetch(self, store: TieredStore, run: tuple[bytes, ...]) -> None:
        """Queue a promotion of `run` to DRAM unless the same run is queued: a request
        waiting to be scheduled, or a hint, asks for the same chunks again."""
        with self._store_lock:
            if not run or run in self._prefetch_queued:
                return
            self._prefetch_queued.add(run)

        def promote() -> None:
            try:
                store.prefetch(run)
            finally:
                with self._store_lock:
                    self._prefetch_queued.discard(run)

        self._prefetcher.submit(promote)

    def _handle(self, op: str, args: tuple[Any, ...], window: AlignedBuffer | None) -> Any:
        store = self.store
        if op == "info":
            info = store.info() if store else {"tiers": [], "counters": {}}
            return {**info, "service_pid": os.getpid(), "socket": self.socket_path}
        if op == "residency":
            if store is None:
                return 0, 0, False
            keys, prefetch = args[0], args[1]
            found = store.lookup(keys)
            run = tuple(keys[: found.count])
            if prefetch:
                self._prefetch(store, run)
            with self._store_lock:
                pending = run in self._prefetch_queued
            return found.count, found.resident, pending
        if op == "count":  # counters a client keeps (the scheduler's prefetch timeliness)
            if store is not None:
                for name, amount in args[0].items():
                    store.stats.add(name, amount)
            return None
        if store is None or window is None:
            raise KVStoreError(f"'{op}' needs a hello with a chunk size first")
        keys, slots = args[0], args[1]
        size = store.chunk_bytes
        if len(keys) != len(slots) or any(not 0 <= s < window.nbytes // size for s in slots):
            raise KVStoreError(f"bad window slots {slots} for {len(keys)} keys")
        views = [window.view[s * size : (s + 1) * size] for s in slots]
        if op == "get":
            return store.get_many(keys, views)
        if op == "put":
            return store.put_many(keys, views, parent=args[2])
        raise KVStoreError(f"unknown request {op!r}")
