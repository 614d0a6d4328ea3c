"""This host's lease in the index: claimed at start, renewed, withdrawn; one host per id.

Peers count a host's entries only while its lease (`P l:<host id>`, index.py) lives and
names the entries' generation. Two hosts started with one `cluster.host_id` would each
overwrite the other's lease and entries, and peers would read the wrong host's devices
at the other's slots (misses, never wrong KV: every read is verified, but a cache that
silently stops working). So the lease also says who holds it (host name, boot id, pid:
index.LeaseHolder), and it is claimed, never blindly overwritten:

- At start, `claim` sets it only where none lives (SET NX). One held by another live
  host refuses the start (HostIdInUse, naming that host); one held by an ended service
  of this same machine (same host name and boot id, its pid gone: a restart within
  `lease_s`), or by a closed store of this very process, is taken over.
- A renewal sets it only while it exists (SET XX GET). Gone (Redis restarted or was
  flushed): claimed again, and the publisher republishes. Holding another generation
  (a host with this id claimed it while this one could not renew): that host's value is
  put back, and this host stops publishing, saying so (`peer.host_id_conflicts`).
- A clean stop deletes it only while this host holds it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading

from kvstore.cluster.connection import FAILURES, IndexConnection
from kvstore.cluster.index import IndexKeys, LeaseHolder
from kvstore.config.store import ClusterConfig
from kvstore.format.errors import ConfigError
from kvstore.tiers.stats import Stats

log = logging.getLogger(__name__)


class HostIdInUse(ConfigError):
    """Another live host holds this host id's lease."""


def _boot_id() -> str:
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()
    return ""


_held: set[tuple[str, bytes]] = set()  # (index URL, lease key) a live HostLease of this process holds
_held_lock = threading.Lock()


def _ended_here(holder: LeaseHolder, where: tuple[str, bytes]) -> bool:
    """`holder` is a service of this machine (this boot) whose process is gone, or an
    earlier store of this very process that is closed (a crash, in a test, then a restart)."""
    if holder.host != socket.gethostname() or holder.boot != _boot_id() or holder.pid <= 0:
        return False
    if holder.pid == os.getpid():
        with _held_lock:
            return where not in _held
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, as another user
        return False
    return False


class HostLease:
    """The lease of `config.host_id` with `generation`, through `index`."""

    def __init__(self, config: ClusterConfig, index: IndexConnection, keys: IndexKeys, generation: int,
                 stats: Stats) -> None:
        self.config = config
        self.stats = stats
        self._index = index
        self._key = keys.lease(config.host_id)
        self._where = (config.index_url, self._key)
        self.mine = LeaseHolder(generation, socket.gethostname(), _boot_id(), os.getpid())
        self.claimed = False
        self.refused = ""  # why this host stopped publishing: another host holds its id
        self.error: Exception | None = None  # the last renewal's failure

    def _set(self, value: bytes, *, nx: bool = False, xx: bool = False, get: bool = False) -> object:
        """SET key value PX lease_s [NX|XX] [GET]: its answer; FAILURES raise."""
        args = (self._key, value, None, int(self.config.lease_s * 1000), nx, xx, False, get)
        answer = self._index.run([("set", args)])[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def claim(self) -> None:
        """Hold the lease: set where none lives, taken over from this machine's ended
        service. HostIdInUse where another live host holds it; FAILURES where the index
        does not answer (the publisher claims again at its next step)."""
        answer = self._set(self.mine.pack(), nx=True, get=True)
        holder = LeaseHolder.unpack(answer) if answer is not None else None
        if answer is not None and holder != self.mine:
            if holder is None or not _ended_here(holder, self._where):
                raise HostIdInUse("cluster.host_id", self.config.host_id,
                                  f"in use by {holder or 'a lease of another format'}, whose lease lives: "
                                  f"give each host its own host_id (if that host was this one before a "
                                  f"restart, its lease runs out within {self.config.lease_s:g} s)")
            log.info("cluster index: host_id %s's lease was this machine's ended service's (%s); "
                     "taken over", self.config.host_id, holder)
            self._set(self.mine.pack())
        self.claimed = True
        with _held_lock:
            _held.add(self._where)

    def renew(self) -> bool | None:
        """Renew the lease (claim it first if not held yet): True; False where the index
        did not answer or another host holds it; None where it was gone and is claimed
        again (the index lost this host's state: publish everything again)."""
        if self.refused:
            return False
        try:
            if not self.claimed:
                self.claim()
                return True
            answer = self._set(self.mine.pack(), xx=True, get=True)
        except HostIdInUse as exc:
            return self._refuse(str(exc), None)
        except FAILURES as exc:
            self.error = exc
            return False
        if answer is None:
            log.warning("cluster index: this host's lease was gone; publishing everything again")
            self.claimed = False
            return None if self.renew() else False
        holder = LeaseHolder.unpack(answer)
        if holder is not None and holder.generation == self.mine.generation:
            return True
        other = holder or "a lease of another format"
        return self._refuse(f"host_id {self.config.host_id} is in use by {other}", answer)

    def _refuse(self, why: str, theirs: object) -> bool:
        """Another host holds this id: put its lease back (`theirs`, where this renewal
        overwrote it) and stop publishing for good."""
        if isinstance(theirs, bytes):
            with contextlib.suppress(*FAILURES):
                self._set(theirs)
        self.claimed = False
        self.refused = why
        self.error = RuntimeError(why)
        self.stats.add("peer.host_id_conflicts")
        log.error("cluster index: %s; this host stops publishing (its lookups go on)", why)
        return False

    def close(self, withdraw: bool) -> None:
        """This store no longer holds the lease; `withdraw` (a clean stop) also ends it now
        where this host holds it, so peers stop reading this host's devices now rather than
        when it would have run out."""
        if withdraw:
            self._withdraw()
        with _held_lock:
            _held.discard(self._where)

    def _withdraw(self) -> None:
        if not self.claimed:
            return
        answer: object = None
        for _ in range(2):  # after a failover the first try may meet the dead master (a stale
            try:  # slot map, which that failure makes the client read again)
                held = self._index.run([("get", (self._key,))])[0]
                answer = self._index.run([("delete", (self._key,))])[0] if held == self.mine.pack() else held
            except FAILURES as exc:
                answer = exc
            if not isinstance(answer, BaseException):
                return
        log.warning("cluster index: lease not withdrawn (%s); it expires in %.0f s", answer,
                    self.config.lease_s)
