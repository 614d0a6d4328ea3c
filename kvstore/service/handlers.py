"""The service's requests: each client's window, and what each request does with the one
store every client shares (shared_store.py, which makes it at the first hello that gives
a chunk size, a worker's, and closes it).

A hello's config must agree with the service's on what both act on: not `service` (the
service's own) nor the keys a SIGHUP reload changes while engines run (LIVE_KEYS); a
refusal names the keys that differ, never their values (they may hold a password). A
residency request covers
every tensor-parallel rank's keys and is answered as one snapshot (prefetches.py, which
runs the promotions it asks for). Invariants: a client's window is registered as a
direct-read region while it lives, and unmapped once no read that missed its deadline
may still land in it (Region.close); a client's DRAM leases are held and given back
through the lease desk (client_leases.py, which states their invariants). Each request
kind has one answer in a table (`Requests._answers`); a hello, which may pass
descriptors, is the one answered apart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvstore.config.store import LIVE_KEYS, StoreConfig, dump_config
from kvstore.format.errors import ConfigError, KVStoreError
from kvstore.format.malformed import KindCounts, MalformedCounts
from kvstore.io.regions import Region
from kvstore.service import protocol as P
from kvstore.service.chunk_events import ChunkEvents
from kvstore.service.client_leases import HeldLeases, LeaseDesk
from kvstore.service.counters import ServiceCounters
from kvstore.service.namespaces import NamespaceBook
from kvstore.service.next_turns import NextTurns
from kvstore.service.prefetches import Prefetches
from kvstore.service.shared_store import SharedStore
from kvstore.service.window import Window
from kvstore.store.tiered import TieredStore
from kvstore.tiers.return_rates import RequestEnd

log = logging.getLogger(__name__)
def disagreement(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """The top-level config keys on which a client and the service differ where both act on
    them: not `service` (the service's own) nor LIVE_KEYS (a reload changes them live)."""
    return sorted(key for key in ours.keys() | theirs.keys()
                  if key != "service" and key not in LIVE_KEYS and ours.get(key) != theirs.get(key))


class Client:
    """What the service keeps for one connection."""

    def __init__(self, channel: P.Channel, uid: int) -> None:
        self.channel = channel
        self.uid = uid  # SO_PEERCRED's at accept
        self.window: Window | None = None
        self.region: Region | None = None
        self.slots = 0
        self.maps_tier = False  # given the DRAM tier to map: only then may it pin
        self.namespace = bytes(16)  # its hello's: what its puts' headers name unless a put says
        self.held = HeldLeases(uid)  # the DRAM leases it holds (client_leases.py)


class Requests:
    """Answers clients' requests against the one store (made at the first data hello)."""

    def __init__(self, config: StoreConfig, socket_path: str, counted: tuple[KindCounts, ...] = ()) -> None:
        self._prefetches = Prefetches()  # promotions to DRAM, one at a time
        self.events = ChunkEvents()  # what engines tell routers (chunk_events.py)
        malformed = MalformedCounts(log)
        self.shared = SharedStore(config, socket_path, self.events, malformed)  # the one store
        self.leases = LeaseDesk(config.service.scheduler_leases)  # every client's DRAM leases
        self._answers: dict[type, Callable[[Client, Any], Any]] = {
            P.Info: lambda client, request: self.counters.info(),
            P.Residency: self._residency,
            P.Finished: self._finished,
            P.Expect: lambda client, request: self.next_turns.expect(request.ranks, request.in_s),
            P.Events: lambda client, request: self.events.since(request.since),
            P.Count: lambda client, request: self.counters.clients.add(self.shared.store, request.counters),
            P.Unpin: self._unpin,
            P.Announce: self._namespaces, P.Namespaces: self._namespaces, P.Purge: self._namespaces,
            P.Pin: self._pin, P.Get: self._get, P.Put: self._put}
        self.next_turns = NextTurns(config.next_turn, config.next_turn_lead_s, self._promote)
        self.namespaces = NamespaceBook(socket_path + ".namespaces", malformed,
                                        self.shared.namespaces)  # announced
        self.namespaces.start()
        self.counters = ServiceCounters(self.shared, self.namespaces, malformed, counted)

    def handle(self, client: Client, request: P.Request) -> tuple[Any, tuple[int, ...]]:
        """The reply to one request, and the descriptors it passes (a hello's only)."""
        self.counters.saw(request)
        if isinstance(request, P.Hello):
            return self._hello(client, request)
        answer = self._answers.get(type(request))
        if answer is None:
            raise KVStoreError(f"unknown request {type(request).__name__}")
        return answer(client, request), ()

    def _finished(self, client: Client, request: P.Finished) -> None:
        self.next_turns.finished(request.ranks)
        store = self.shared.store
        if store is not None and request.answer_tokens is not None:  # how it ended: admission learns
            store.finished(request.ranks, RequestEnd(request.answer_tokens, request.turn, request.idle_s))

    def _unpin(self, client: Client, request: P.Unpin) -> None:
        good, bad = set(request.good), set(request.bad)
        for number in request.leases:
            self.leases.release(self.shared.store, client.held, number, good, bad)

    def _namespaces(self, client: Client, request: P.Announce | P.Namespaces | P.Purge) -> Any:
        return self.namespaces.handle(P.peer_credentials(client.channel.sock)[1], self.shared.store, request)

    def _pin(self, client: Client, request: P.Pin) -> list[Any]:
        store = self.shared.store
        if store is None or client.window is None:
            raise KVStoreError("'Pin' needs a hello with a chunk size first")
        if not client.maps_tier:
            raise KVStoreError("this connection was not given the DRAM tier (service.share_dram): "
                               "load through the window")
        return self.leases.pin(store, client.held, request.keys, request.verify, client.slots)

    def _views(self, client: Client, request: P.Get | P.Put) -> tuple[TieredStore, list[memoryview]]:
        """The store and the window slots a Get or Put names, checked."""
        store, window = self.shared.store, client.window
        if store is None or window is None:
            raise KVStoreError(f"'{type(request).__name__}' needs a hello with a chunk size first")
        size = store.chunk_bytes
        if len(request.keys) != len(request.slots) or any(not 0 <= s < client.slots for s in request.slots):
            raise KVStoreError(f"bad window slots {request.slots} for {len(request.keys)} keys "
                               f"(the window has {client.slots})")
        return store, [window.view[s * size : (s + 1) * size] for s in request.slots]

    def _get(self, client: Client, request: P.Get) -> list[bool]:
        store, views = self._views(client, request)
        return store.get_many(request.keys, views)

    def _put(self, client: Client, request: P.Put) -> list[bool]:
        store, views = self._views(client, request)
        namespace = request.namespace or client.namespace
        with self.namespaces.storing(namespace):  # its records are not forgotten meanwhile
            return store.put_many(request.keys, views, request.parent, namespace)

    def _hello(self, client: Client, hello: P.Hello) -> tuple[Any, tuple[int, ...]]:
        if hello.version != P.PROTOCOL_VERSION:
            raise KVStoreError(f"this client speaks protocol {hello.version}, the service at "
                               f"{self.shared.socket_path} speaks {P.PROTOCOL_VERSION}: restart it with "
                               "the same kvstore version (kvstore stop)")
        differ = disagreement(dump_config(self.shared.config), hello.config)
        if differ:
            raise ConfigError("service.socket", self.shared.socket_path,
                              f"a kvstore service with another config listens there (they differ in "
                              f"{', '.join(k[:64] for k in differ[:16])}); stop it (kvstore stop) or "
                              "use another socket")
        if hello.chunk_bytes is None:
            return None, ()
        client.namespace = hello.namespace
        if client.window is not None:
            raise KVStoreError("this connection has a window already")
        store = self.shared.join(client.uid, hello.chunk_bytes, hello)
        slots = max(1, self.shared.config.service.staging // hello.chunk_bytes)
        window, fd = Window.make(slots * hello.chunk_bytes)
        client.window, client.slots = window, slots
        client.region = store.regions.add(window.address, window.nbytes, window)
        reply = {"slots": slots, "window_bytes": window.nbytes, "pages": window.pages}
        shared = store.share_dram() if self.shared.may_map_dram(client.uid) else None
        if shared is None:
            return reply, (fd,)
        tier_fd, tier_bytes, tier_pages = shared
        client.maps_tier = True
        return {**reply, "tier_bytes": tier_bytes, "tier_pages": tier_pages}, (fd, tier_fd)

    def _residency(self, client: Client, request: P.Residency) -> list[Any]:
        """One prompt's residency snapshot, after the counters and releases the request carries;
        with `lease_from`, the leading chunks every rank has in DRAM from that one on leased
        for the client's engine workers (client_leases.py: the lookup that decides a load
        protects it, and they copy with no request of their own), where the client may map
        the tier."""
        store = self.shared.store
        self.counters.clients.add(store, request.counters)
        for number in request.release:
            self.leases.release(store, client.held, number)
        self.next_turns.arrived(request.ranks)
        found: list[Any] = [0, 0, False]
        if store is not None and request.ranks:
            found = self._prefetches.residency(store, request.ranks, request.prefetch, request.await_s)
        if request.lease_from is None:
            return found
        if store is None or not self.shared.may_map_dram(client.uid):
            return [*found, 0, []]
        return found + self.leases.lease_run(store, client.held, request.ranks, request.lease_from,
                                             int(found[1]))

    def _promote(self, keys: tuple[bytes, ...]) -> None:
        """A chain next-turn prediction wants in DRAM now."""
        store = self.shared.store
        if store is not None:
            self._prefetches.promote(store, keys)

    def forget(self, client: Client) -> None:
        """A client left (or died): its pins go, and its window, unmapped once no late read
        may still land in it."""
        self.leases.release_all(self.shared.store, client.held)
        if client.region is not None:
            self.shared.unregister(client.region)
        if client.window is not None:
            if client.region is not None:
                client.region.close(client.window.close)
            else:
                client.window.close()

    def close(self) -> None:
        """Predictions and prefetches stopped, then the store closed (drained, checkpointed)."""
        self.next_turns.close()
        self.namespaces.close()
        self._prefetches.close()
        self.shared.close()
