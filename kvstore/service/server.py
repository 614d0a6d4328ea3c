"""`kvstore serve`: one process per host owns the tiers; engines talk to it over a socket.

Why a service: vLLM runs its scheduler and each tensor-parallel worker in separate
processes, and several engines may share a host. The scheduler must answer "how
much of this prompt is stored?" about chunks that workers wrote, and two processes
must never drive one slot map. So one process owns the DRAM slab and the disks
(each path flock'ed), and clients send it small requests (protocol.py) over a Unix
socket in a private directory (runtime.py).

Data never crosses the socket. The service gives each data client a window
(window.py) it maps too: a get fills the client's window slots (from DRAM by
memcpy, from disk by O_DIRECT reads straight into the window), a put reads them.
A worker's load or save is thus a plain copy between its KV tensors and its window.

Sharing a host safely: only peers of this user (or uids/gids the config allows)
are served, and only this user may stop it; frames are size-limited and every field
bounded (a frame that is not one is counted, `malformed.frame`, and ends that
connection); clients are bounded in number, each other user to its share and all of them
to what the owner's reserve leaves (client_slots.py), and one that says no hello in time
is closed (`service.hello_timeout_s`); a request that fails is an error reply for
that client (with any URL's password masked), never the end of the service; SIGTERM
always ends it cleanly; a SIGHUP reload that cannot be read or applied changes nothing
(counted, `malformed.config`); and while it runs it holds SOCKET.lock, so a second
`kvstore serve` on the same socket refuses to start instead of stealing it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvstore.config.runtime import ensure_private_directory, open_private
from kvstore.config.store import LIVE_KEYS, StoreConfig, dump_config, load_config
from kvstore.devices.device import path_problem
from kvstore.devices.nvmeof.plans import namespace_plans
from kvstore.format.checksum import PIECE
from kvstore.format.errors import ConfigError, DeviceError, KVStoreError
from kvstore.format.malformed import Malformed, MalformedCounts
from kvstore.format.secrets import masked
from kvstore.io.streaming import streaming_thresholds, streaming_tunable
from kvstore.service import protocol as P
from kvstore.service.client_slots import ClientSlots
from kvstore.service.handlers import Requests
from kvstore.service.sessions import Client
from kvstore.service.signal_flag import LoopSignals, SignalFlag

log = logging.getLogger(__name__)
_BACKLOG = 64
_ACCEPT_BACKOFF_S = (0.05, 1.0)


class ServiceRunning(KVStoreError):
    """Another service already holds this socket's lock."""


def check_paths_usable(config: StoreConfig) -> None:
    """Fail at start-up, naming the field, when a disk path cannot be used. The store
    itself is made when the first worker says its chunk size: too late for a clear error."""
    if config.nvmeof is not None:
        try:
            namespace_plans(config.nvmeof)
        except DeviceError as exc:
            raise ConfigError("tiers.nvmeof", exc.path, str(exc)) from None
    for i, disk in enumerate(config.disk):
        problem = path_problem(disk.path)
        if problem:
            raise ConfigError(f"tiers.disk[{i}].path", disk.path, problem)


def policy_reload(running: StoreConfig, fresh: StoreConfig) -> tuple[dict[str, Any], list[str], StoreConfig]:
    """What a reload applies: the changed LIVE_KEYS, the other top-level keys changed (a
    restart applies them), and the running config with the live ones changed, validated
    (a ConfigError if they do not go with what keeps running, e.g. write_through)."""
    old, new = dump_config(running), dump_config(fresh)
    live = {key: new[key] for key in LIVE_KEYS if new[key] != old[key]}
    restart = sorted(key for key in old.keys() | new.keys()
                     if key not in LIVE_KEYS and old.get(key) != new.get(key))
    return live, restart, load_config({**old, **live})


def reread(reload: Callable[[], StoreConfig], running: StoreConfig,
           malformed: MalformedCounts) -> tuple[dict[str, Any], list[str], StoreConfig] | None:
    """policy_reload of the config file as it is now, or None if it cannot be read or
    applied (missing, unreadable, not UTF-8, nested too deep, invalid): logged with why and
    counted (`malformed.config`); the service goes on as it was."""
    try:
        return policy_reload(running, reload())
    except Exception as exc:  # whatever the file holds
        why = masked(str(exc) if isinstance(exc, KVStoreError) else f"{type(exc).__name__}: {exc}")[:2000]
        log.warning("reload: the config is unchanged: %s", why)
        malformed.count(Malformed("config", why), logged=True)
        return None


def _refuse(channel: P.Channel, why: str) -> None:
    """Tell a client why (if it still listens) and hang up."""
    with contextlib.suppress(OSError):
        channel.send(P.Reply(False, error=why))
    channel.close()


def send_reply(channel: P.Channel, reply: P.Reply, fds: tuple[int, ...], request: str,
                malformed: MalformedCounts) -> bool:
    """Send a request's reply; False if the client has gone. One that cannot go out (over
    the frame limit, not encodable: nothing of it was sent) is an error reply saying why,
    counted (`malformed.reply`): never the end of the client's thread."""
    try:
        channel.send(reply, fds)
    except OSError:
        log.warning("a client left before its reply (past its deadline?)")
        return False
    except Exception as exc:
        why = masked(f"the reply to {request} was not sent: {exc}")[:1000]
        malformed.count(Malformed("reply", why), "an error reply sent instead")
        try:
            channel.send(P.Reply(False, error=why))
        except OSError:
            return False
    return True


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
        self.config = config
        self.socket_path = config.service.socket
        ensure_private_directory(self.socket_path, others_connect=bool(
            config.service.allowed_uids or config.service.allowed_gids))
        self._lock_fd = open_private(self.socket_path + ".lock", os.O_RDWR)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise ServiceRunning(f"a kvstore service already runs at {self.socket_path} (it holds "
                                 f"{self.socket_path}.lock); stop it first: kvstore stop") from None
        try:
            self._start(config)
        except BaseException:
            os.close(self._lock_fd)
            raise

    def _start(self, config: StoreConfig) -> None:
        _unpin_from_parent()
        tunable = streaming_tunable(PIECE, streaming_thresholds())
        if tunable is not None:  # started by hand: a spawned service has it (client_connection.py)
            log.info("a put copies into its DRAM slot %d bytes at a time, which do not stream under "
                     "this process's glibc thresholds: start `kvstore serve` with GLIBC_TUNABLES=%s for "
                     "less CPU per put (docs/architecture.md)", PIECE, tunable)
        self._slots = ClientSlots(config.service, os.geteuid(), log)
        self.requests = Requests(config, self.socket_path, (self._slots.counts,))
        self._stopping = threading.Event()
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)  # a dead service's socket: we hold the lock now
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177 if not config.service.allowed_uids and not config.service.allowed_gids
                             else 0o111)
        try:
            self._listener.bind(self.socket_path)
        finally:
            os.umask(old_umask)
        self._listener.listen(_BACKLOG)
        if config.service.metrics_port:
            from kvstore.service.metrics import serve_metrics

            serve_metrics(config.service.metrics_host, config.service.metrics_port,
                          lambda: self.requests.shared.store, self.requests.counters.own)

    # -- the accept loop ---------------------------------------------------------------

    def serve_forever(self, reload: Callable[[], StoreConfig] | None = None,
                      hung_up: SignalFlag | None = None) -> None:
        """Serve until a client sends shutdown or the process gets SIGTERM/SIGINT; on
        SIGHUP, `reload` (the config file read again) is applied (`_reload`). `hung_up`:
        raised by who caught SIGHUP before (`kvstore serve`, from its first line). The
        handlers only raise a flag and wake this loop, which acts (signal_flag.py)."""
        try:
            with LoopSignals(self._wake_write, hung_up, hangup=reload is not None) as signals:
                self._accept_until_stopped(signals, reload)
        finally:  # once LoopSignals no longer writes to the pipe that _close closes
            self._close()

    def _accept_until_stopped(self, signals: LoopSignals, reload: Callable[[], StoreConfig] | None) -> None:
        """serve_forever's loop: accept clients, act on the signals' flags, until stopped."""
        log.warning("kvstore service listening on %s", self.socket_path)
        backoff = _ACCEPT_BACKOFF_S[0]
        poller = select.poll()
        poller.register(self._listener, select.POLLIN)
        poller.register(self._wake_read, select.POLLIN)
        while not self._stopping.is_set():
            ready = poller.poll()
            if any(fd == self._wake_read for fd, _ in ready):  # drained before the flag is read:
                with contextlib.suppress(BlockingIOError):  # a SIGHUP after it wakes us again
                    os.read(self._wake_read, 64)
            if signals.ended.take():
                self._stopping.set()
                break
            if reload is not None and signals.reloads.take():
                self._reload(reload)
            if not any(fd == self._listener.fileno() for fd, _ in ready):
                continue
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:  # out of descriptors or memory: wait, never exit
                log.warning("accept failed (%s); retrying in %.2f s", exc.strerror, backoff)
                time.sleep(backoff)
                backoff = min(2 * backoff, _ACCEPT_BACKOFF_S[1])
                continue
            backoff = _ACCEPT_BACKOFF_S[0]
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        """Serve a new connection on a thread of its own if its user may take a slot
        (ClientSlots), else refuse it; it must say hello within service.hello_timeout_s."""
        channel = P.Channel(conn, keeps=0)  # a client passes the service no descriptor
        _, uid, gid = P.peer_credentials(conn)
        refused = self._slots.take(uid, gid)
        if refused is not None:
            _refuse(channel, refused)
            return
        client = Client(channel, uid)
        hello_by = time.monotonic() + self.config.service.hello_timeout_s
        try:
            threading.Thread(target=self._serve_client, args=(client, hello_by), daemon=True,
                             name="kvstore-client").start()
        except RuntimeError as exc:  # no thread to be had (a ulimit): this client only is refused
            log.warning("refused a client: %s", exc)
            self._forget(client)

    def stop(self) -> None:
        """Make serve_forever return (from any thread)."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"x")

    def _reload(self, reload: Callable[[], StoreConfig]) -> None:
        """Apply the config file as it is now: LIVE_KEYS at once (StoreAdmin.reload_policy
        keeps every chunk a tier holds), anything else changed only logged, as it needs a
        restart. A file that cannot be read changes nothing (`reread`); a policy switch that
        fails is logged and counted, and leaves the running config (SharedStore.reload).
        Engines connected before keep connecting with the config they started with (the
        hello leaves LIVE_KEYS out)."""
        fresh = reread(reload, self.config, self.requests.counters.malformed)
        if fresh is None:
            return
        live, restart, merged = fresh
        if restart:
            log.warning("reload: %s changed: applied only by a restart", ", ".join(restart))
        if not self.requests.shared.reload(live, merged):
            return  # the switch failed (logged, counted): the service goes on as it was
        self.config = merged
        log.warning("reload: %s", ", ".join(f"{k} {v}" for k, v in live.items()) or "no policy changed")

    def _close(self) -> None:
        """Store first, socket last: while the socket exists the tiers are still held,
        so whoever waits for it to vanish (`kvstore stop`) can start a successor."""
        self.requests.close()
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        for fd in (self._wake_read, self._wake_write, self._lock_fd):
            os.close(fd)

    # -- one client ------------------------------------------------------------------

    def _serve_client(self, client: Client, hello_by: float) -> None:
        """Answer the client's requests until it leaves; until it has said hello, every
        frame (the first byte included) must have arrived by `hello_by` (time.monotonic)."""
        channel, malformed = client.channel, self.requests.counters.malformed
        said_hello = False
        try:
            while True:
                wait_s = None if said_hello else max(0.0, hello_by - time.monotonic())
                try:
                    request = channel.recv(P.REQUEST, wait_s)
                except TimeoutError:  # before its hello: silent, or too slow; after: a frame past its 30 s
                    if not said_hello:
                        self._slots.hello_timeout(client.uid)
                    return
                except (EOFError, OSError):
                    return
                except P.ProtocolError as exc:
                    malformed.count(Malformed("frame", str(exc)[:300]), "connection closed")
                    _refuse(channel, str(exc)[:1000])  # the stream cannot be trusted any more
                    return
                fds: tuple[int, ...] = ()
                try:
                    if isinstance(request, P.Shutdown):
                        if client.uid != os.geteuid():
                            raise KVStoreError("only the service's own user may stop it")
                        channel.send(P.Reply(True))
                        self.stop()
                        return
                    value, fds = self.requests.handle(client, request)
                    reply = P.Reply(True, value)
                    said_hello = said_hello or isinstance(request, P.Hello)
                except KVStoreError as exc:
                    reply = P.Reply(False, error=masked(str(exc)))
                except Exception as exc:  # a bug must not take the whole service down
                    log.exception("request %s failed", type(request).__name__)
                    reply = P.Reply(False, error=masked(f"{type(exc).__name__}: {exc}"[:2000]))
                try:
                    if not send_reply(channel, reply, fds, type(request).__name__, malformed):
                        return
                finally:
                    for fd in fds:
                        os.close(fd)
                if client.region is not None and client.region.late:
                    return  # a read into its window may still land: it must reconnect, fresh
        finally:
            self._forget(client)

    def _forget(self, client: Client) -> None:
        self._slots.give_back(client.uid)
        self.requests.forget(client)
        client.channel.close()
