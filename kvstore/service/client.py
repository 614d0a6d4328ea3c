"""Client of the per-host service: the service's requests as typed calls (lookup, get,
put, pin, the owner's admin calls) over one connection (client_connection.py), and the
memory the service shares with a data client (client_memory.py).

A client is used by one thread at a time (a connection carries one request at a
time); an engine worker keeps one for loads and one for saves. Every request has
a deadline: a service that does not answer in time costs a miss, never a hang.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from kvstore.config.store import StoreConfig, dump_config, with_service
from kvstore.format.errors import ConfigError, KVStoreError
from kvstore.service import protocol as P
from kvstore.service.client_connection import Connection, ServiceUnavailable, connect, listening
from kvstore.service.client_memory import ClientMemory
from kvstore.service.service_process import ServiceProcess
from kvstore.tiers.return_rates import RequestEnd

log = logging.getLogger("kvstore.client")
HELLO_TIMEOUT_S = 10.0

# What each reply's value must be (protocol.py's list), checked by protocol.reply_as.
_Offset = Annotated[int, msgspec.Meta(ge=-1)]  # a payload's offset in the DRAM tier; -1: not pinned
_Natural = Annotated[int, msgspec.Meta(ge=0)]
_FOUND = tuple[P.Whole, P.Whole, bool]
_LEASE = tuple[P.Whole, list[list[_Offset]]]
_PINNED = tuple[P.Whole, list[_Offset], list[_Natural | None]]  # a check: an xxh3-64, unsigned
_EVENTS = tuple[_Natural, _Natural, list[tuple[bool, P.Key, P.Name]]]


class StoreClient:
    """The service's requests as typed calls, over one connection it says hello on.

    The hello introduces the client (config, chunk size, namespace, KV dtype and shape);
    with a chunk size it brings the client's `memory` (client_memory.py): `get(keys,
    slots)` fills window slot slots[i] (`memory.slot(n)` is its view) with chunk keys[i],
    `put(keys, slots)` stores chunk keys[i] from slot slots[i], and where the service
    shares its DRAM tier and `map_tier` asks for it (a client that loads), `pin(keys)`
    pins the DRAM hits and says where each payload is (`memory.tier_payload`), for the
    caller to copy out itself before `unpin`. Without one (a scheduler) it maps nothing
    and asks the rest: lookups, hints, counters, the owner's admin calls. Each call
    checks and shapes its arguments and its reply; a prompt too long for one frame is
    asked about in pieces (`lookup`). Invariants: one request at a time; the connection
    (client_connection.py) carries each under `timeout_s` (default: twice io.timeout_s);
    `disconnect()` leaves the memory mapped for copies still in flight, `close()` unmaps it.
    """

    def __init__(self, config: StoreConfig, chunk_bytes: int | None = None, *,
                 namespace: bytes = bytes(16), dtype: str = "uint8",
                 shape: tuple[int, ...] = (), timeout_s: float | None = None,
                 map_tier: bool = True) -> None:
        self.config = config
        self.memory = ClientMemory()
        self._conn = Connection(connect(config), 2 * config.io.timeout_s if timeout_s is None else timeout_s)
        try:
            # The first hello with a chunk size makes the store (opens the tiers, recovers
            # their index): it may take longer than a short request deadline allows.
            hello_timeout_s = max(self.timeout_s, HELLO_TIMEOUT_S) if chunk_bytes else self.timeout_s
            reply = self._conn.request(P.Hello(P.PROTOCOL_VERSION, dump_config(config), chunk_bytes,
                                               namespace, dtype, tuple(shape)), hello_timeout_s)
            if chunk_bytes is not None:
                self.memory = ClientMemory.from_hello(chunk_bytes, reply, self._conn.take_fd, map_tier)
        except BaseException:
            self.disconnect()
            raise

    @property
    def timeout_s(self) -> float:
        """Each request's deadline (a ServiceLink waits that long for a reconnect)."""
        return self._conn.timeout_s

    def residency(self, keys: Sequence[bytes], prefetch: bool = False) -> tuple[int, int, bool]:
        """(leading chunks present, of those already in DRAM, whether a promotion of that
        run is queued or running). `prefetch` starts moving the run up to DRAM (its disk
        part read, the rest touched): the hint API, for keys a request will want."""
        return self.residency_ranks([keys], prefetch)

    def residency_ranks(self, ranks: Sequence[Sequence[bytes]], prefetch: bool = False,
                        await_s: float = 0.0) -> tuple[int, int, bool]:
        """`residency` of one prompt whose keys differ per tensor-parallel rank: a chunk
        counts only where every rank's copy is there; one request, one snapshot. `await_s`: a
        request is held that long (at most protocol.MAX_AWAIT_S) for what is not found; the
        service watches the cluster index for it meanwhile."""
        found = self.lookup(ranks, prefetch, await_s=await_s)
        return found.stored, found.resident, found.pending

    def lookup(self, ranks: Sequence[Sequence[bytes]], prefetch: bool = False, lease_from: int | None = None,
               release: Sequence[int] = (), counters: Mapping[str, float] | None = None,
               await_s: float = 0.0, unread: Sequence[int] = ()) -> Found:
        """`residency_ranks`, with what a scheduler's lookup carries: `release` (leases it is done
        with, their loads carried out: each chunk a get), `unread` (done with, no load carried out
        from them: no gets) and `counters` (added as by `count`) go first, and with `lease_from` the
        leading chunks every rank has in DRAM, from that one on (those before it the engine holds),
        come back pinned for its workers (`Found.lease`, 0 for none; `Found.offsets[rank][i]`: chunk
        i's payload in the tier, -1 where not pinned). A prompt with more keys than one frame
        carries (protocol.MAX_KEYS, every rank's together) is asked about a piece of chunks at a
        time, the next only while all of one is stored; only the first piece carries the rest and is
        leased."""
        lists = [list(k) for k in ranks]
        step = _per_rank(lists)
        extras: dict[str, Any] = {"lease_from": lease_from, "release": list(release),
                                  "unread": list(unread), "counters": dict(counters or {})}
        stored = resident = number = 0
        pending = False
        offsets: tuple[tuple[int, ...], ...] = ()
        for start in range(0, max(1, max((len(k) for k in lists), default=0)), step):
            piece = [k[start : start + step] for k in lists]
            reply = self._conn.request(P.Residency(piece, prefetch, min(await_s, P.MAX_AWAIT_S), **extras))
            run, in_dram, promoting, lease, leased = _found(reply, piece, lease_from or 0)
            if start == 0:
                number, offsets = lease, leased
            extras = {}
            if resident == stored:  # a leading run: DRAM's continues only where all before was there
                resident += in_dram
            stored += run
            pending = pending or promoting
            if run < min((len(k) for k in piece), default=0):
                break
        return Found(stored, resident, pending, number, offsets)

    def finished(self, ranks: Sequence[Sequence[bytes]], end: RequestEnd | None = None) -> None:
        """A request's stored chunks (prompt and answer, per rank) ended: the service expects
        the conversation back and brings them into DRAM before (config `next_turn`); `end`,
        how it ended, is what `learned` disk admission learns from. A chain longer than one
        frame carries is told by its leading part."""
        lists = [list(k) for k in ranks]
        leading = [k[: _per_rank(lists)] for k in lists]
        if end is None:
            self._conn.request(P.Finished(leading))
        else:
            self._conn.request(P.Finished(leading, end.answer_tokens, end.turn, end.idle_s))

    def expect(self, ranks: Sequence[Sequence[bytes]], in_s: float) -> None:
        """A hint: these chunks (their leading part, as `finished`) are wanted in `in_s`
        seconds, finite and at most protocol.MAX_EXPECT_S (else a KVStoreError)."""
        if not 0 <= in_s <= P.MAX_EXPECT_S:  # NaN too
            raise KVStoreError(f"a hint's in_s must be between 0 and {P.MAX_EXPECT_S:g} s, not {in_s}")
        lists = [list(k) for k in ranks]
        self._conn.request(P.Expect([k[: _per_rank(lists)] for k in lists], float(in_s)))

    def count(self, counters: Mapping[str, float]) -> None:
        """Add to the service's counters (shown by `kvstore info` and Prometheus)."""
        self._conn.request(P.Count(dict(counters)))

    def get(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[bool]:
        return _per_key(self._conn.request(P.Get(list(keys), list(slots))), len(keys), "get")

    def put(self, keys: Sequence[bytes], slots: Sequence[int],
            parent: bytes | None = None, namespace: bytes | None = None) -> list[bool]:
        """Store chunk keys[i] from window slot slots[i]; their headers name `namespace`
        (the digest of the namespace the keys were made in; None: this client's hello's)."""
        reply = self._conn.request(P.Put(list(keys), list(slots), parent, namespace))
        return _per_key(reply, len(keys), "put")

    def announce(self, namespaces: Sequence[tuple[bytes, Mapping[str, str | int]]]) -> None:
        """Tell the service which namespaces this client stores under, described (their
        digest, and KVNamespace.description()), so its owner can purge them by name."""
        self._conn.request(P.Announce([(digest, dict(description)) for digest, description in namespaces]))

    def namespaces(self, after: bytes | None = None, limit: int = P.MAX_PAGE) -> list[dict[str, Any]]:
        """One page of the namespaces clients announced, in digest order after `after`
        (None: from the first); empty after the last. The service's owner only."""
        kind = Annotated[list[dict[str, Any]], msgspec.Meta(max_length=limit)]
        page: list[dict[str, Any]] = P.reply_as(self._conn.request(P.Namespaces(after, limit)), kind,
                                                "a namespaces page")
        return page

    def purge(self, namespaces: Sequence[bytes], dry_run: bool = True) -> dict[str, int]:
        """Remove (or, with `dry_run`, count) the records of these namespace digests from
        every tier of this host (the service's owner only)."""
        reply = self._conn.request(P.Purge(list(namespaces), dry_run), max(self.timeout_s, 600.0))
        removed: dict[str, int] = P.reply_as(reply, dict[str, int], "a purge")
        return removed

    def pin(self, keys: Sequence[bytes], verify: bool = True, release: Sequence[int] = (),
            good: Sequence[bytes] = (), bad: Sequence[bytes] = ()) -> tuple[int, list[int], list[int | None]]:
        """(lease, offsets, checks): chunk keys[i]'s payload is at offsets[i] of the DRAM tier
        (-1: not in DRAM), pinned until `unpin(lease)` or this connection ends. Without
        `verify` a disk hit's payload may come unverified: checks[i] is the xxh3-64 it must
        have (None: verified), which the caller checks as it copies it, naming those that
        failed in its `unpin`. `release`, `good`, `bad`: an `unpin` done first, in the same
        round trip."""
        done = P.Unpin(list(release), list(good), list(bad)) if release else None
        reply = self._conn.request(P.Pin(list(keys), verify, done))
        lease, offsets, checks = P.reply_as(reply, _PINNED, "a pin")
        if len(offsets) != len(keys) or len(checks) > len(keys):
            raise P.ProtocolError(f"a pin of {len(keys)} keys answered {len(offsets)} offsets")
        return lease, offsets, checks

    def unpin(self, leases: Sequence[int], good: Sequence[bytes] = (), bad: Sequence[bytes] = ()) -> None:
        """Give leases back; of their unverified chunks, `good` were verified as they were
        copied and `bad` had another checksum (the others go back unpublished)."""
        self._conn.request(P.Unpin(list(leases), list(good), list(bad)))

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = P.reply_as(self._conn.request(P.Info()), dict[str, Any], "an info")
        return info

    def events(self, since: int) -> tuple[int, int, list[tuple[bool, bytes, str]]]:
        """Chunks that entered or left a tier since cursor `since` (kvstore/service/chunk_events.py):
        (the next cursor, events lost, [(stored?, key, medium), ...])."""
        events: tuple[int, int, list[tuple[bool, bytes, str]]] = P.reply_as(
            self._conn.request(P.Events(since)), _EVENTS, "an events")
        return events

    def shutdown(self, timeout_s: float = 300.0) -> None:
        """Ask the service to drain, checkpoint and exit; return once it has (its socket
        is gone), so a successor can take the tiers at once."""
        self._conn.request(P.Shutdown())
        self.close()
        _wait_gone(self.config.service.socket, timeout_s)

    def close(self) -> None:
        self.disconnect()
        self.memory.close()

    def disconnect(self) -> None:
        """Close the connection; the window stays mapped for copies still in flight."""
        self._conn.close()


@dataclass(frozen=True)
class Found:
    """A lookup's answer (StoreClient.lookup): leading chunks every rank has, of those in
    DRAM, whether a promotion of the run is under way, and the lease of the DRAM ones (0:
    none) with each rank's payload offsets in the tier (-1: not pinned)."""

    stored: int
    resident: int
    pending: bool
    lease: int = 0
    offsets: tuple[tuple[int, ...], ...] = ()


def _per_key(reply: Any, count: int, what: str) -> list[bool]:
    """A reply of one bool per key, checked: a service that answers otherwise is a
    protocol error (KVStoreError), never a list that pairs answers with the wrong keys."""
    if not isinstance(reply, list) or len(reply) != count or not all(isinstance(ok, bool) for ok in reply):
        raise P.ProtocolError(f"a {what} of {count} keys was not answered with {count} bools")
    return reply


def _found(reply: Any, piece: Sequence[Sequence[bytes]],
           first: int) -> tuple[int, int, bool, int, tuple[tuple[int, ...], ...]]:
    """A Residency reply, checked: (stored, resident, pending, lease, offsets per rank from
    chunk 0, -1 before `first`, where its lease part starts; 0 and () without one). A run
    longer than the shortest rank's keys, a DRAM run longer than it, or offsets for other
    ranks or past the DRAM run are a protocol error, never a load of chunks not asked about."""
    if not isinstance(reply, list) or len(reply) not in (3, 5):
        raise P.ProtocolError("a lookup was not answered with [stored, resident, pending(, lease, offsets)]")
    stored, resident, pending = P.reply_as(reply[:3], _FOUND, "a lookup")
    lease, offsets = P.reply_as(reply[3:], _LEASE, "a lookup's lease") if len(reply) == 5 else (0, [])
    keys = min((len(k) for k in piece), default=0)
    if not resident <= stored <= keys:
        raise P.ProtocolError(f"a lookup of {keys} chunks answered {stored} stored, {resident} in DRAM")
    if offsets and (len(offsets) != len(piece) or any(len(rank) > resident - first for rank in offsets)):
        raise P.ProtocolError(f"a lookup's lease of chunks {first} to {resident} of {len(piece)} ranks "
                              f"answered {[len(rank) for rank in offsets]} offsets")
    return stored, resident, pending, lease, tuple((-1,) * first + tuple(rank) for rank in offsets)


def _per_rank(ranks: Sequence[Sequence[bytes]]) -> int:
    """Keys of each rank's list that one frame carries for all of them (protocol.MAX_KEYS)."""
    return max(1, P.MAX_KEYS // max(1, len(ranks)))


def attach(config: StoreConfig) -> StoreClient:
    """A lookup-only client of a running service; never starts one."""
    return StoreClient(with_service(config, spawn=False))


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


def stop_service(config: StoreConfig, timeout_s: float = 300.0) -> bool:
    """Ask the service at config.service.socket to drain and exit, and wait until it has;
    False if none runs there. Its owner can always stop it: where the service takes no
    client for the request (its hello refused, every slot held, or unanswered: hung), the
    service's own process, found by the lock it holds (service_process.py), is sent SIGTERM,
    which ends it as cleanly. Anything else that listens there is never signalled: its
    refusal is raised."""
    try:
        client = attach(config)
    except ConfigError:
        raise
    except KVStoreError as exc:
        process = ServiceProcess.find(config.service.socket)
        if process is None:
            if isinstance(exc, ServiceUnavailable) and not listening(config):
                return False
            raise
        with process:
            log.warning("kvstore service (pid %d) takes no client (%s): sending it SIGTERM", process.pid, exc)
            process.terminate(timeout_s)
        return True
    client.shutdown(timeout_s)
    return True


def _wait_gone(socket_path: str, timeout_s: float) -> None:
    """Return once the service's socket is gone (it unlinks it last, on its way out)."""
    deadline = time.monotonic() + timeout_s
    while os.path.exists(socket_path):
        if time.monotonic() > deadline:
            raise ServiceUnavailable(f"kvstore service at {socket_path} did not exit "
                                     f"within {timeout_s:.0f} s")
        time.sleep(0.02)
