"""The service's requests: what each request does with the one store every client shares
(shared_store.py, which makes it at the first hello that gives a chunk size, a worker's,
and closes it).

A client's session (its hello, its window, its leaving) is sessions.py's, and chunks moving
between it and the store (Get, Put, Pin, Unpin) transfers.py's. A residency
request covers every tensor-parallel rank's keys and is answered as one snapshot
(prefetches.py, which runs the promotions it asks for). A client's DRAM leases are held
and given back through the lease desk (client_leases.py, which states their invariants).
Each request kind has one answer in a table (`Requests._answers`); a hello, which may
pass descriptors, is the one answered apart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvstore.config.store import StoreConfig
from kvstore.format.errors import KVStoreError
from kvstore.format.malformed import KindCounts, MalformedCounts
from kvstore.service import protocol as P
from kvstore.service.chunk_events import ChunkEvents
from kvstore.service.client_leases import LeaseDesk
from kvstore.service.counters import ServiceCounters
from kvstore.service.namespaces import NamespaceBook
from kvstore.service.next_turns import NextTurns
from kvstore.service.prefetches import Prefetches
from kvstore.service.sessions import Client, Sessions
from kvstore.service.shared_store import SharedStore
from kvstore.service.transfers import Transfers
from kvstore.tiers.return_rates import RequestEnd

log = logging.getLogger(__name__)


class Requests:
    """Answers clients' requests against the one store (made at the first data hello)."""

    def __init__(self, config: StoreConfig, socket_path: str, counted: tuple[KindCounts, ...] = ()) -> None:
        self._prefetches = Prefetches()  # promotions to DRAM, one at a time
        self.events = ChunkEvents()  # what engines tell routers (chunk_events.py)
        malformed = MalformedCounts(log)
        self.shared = SharedStore(config, socket_path, self.events, malformed)  # the one store
        self.leases = LeaseDesk(config.service.scheduler_leases)  # every client's DRAM leases
        self._sessions = Sessions(self.shared, self.leases)  # hello, and a client leaving
        self.namespaces = NamespaceBook(socket_path + ".namespaces", malformed,
                                        self.shared.namespaces)  # announced
        transfers = Transfers(self.shared, self.leases, self.namespaces)
        self._answers: dict[type, Callable[[Client, Any], Any]] = {
            P.Info: lambda client, request: self.counters.info(),
            P.Residency: self._residency,
            P.Finished: self._finished,
            P.Expect: lambda client, request: self.next_turns.expect(request.ranks, request.in_s),
            P.Events: lambda client, request: self.events.since(request.since),
            P.Count: lambda client, request: self.counters.clients.add(self.shared.store, request.counters),
            P.Announce: self._namespaces, P.Namespaces: self._namespaces, P.Purge: self._namespaces,
            P.Get: transfers.get, P.Put: transfers.put, P.Pin: transfers.pin, P.Unpin: transfers.unpin}
        self.next_turns = NextTurns(config.next_turn, config.next_turn_lead_s, self._promote)
        self.namespaces.start()
        self.counters = ServiceCounters(self.shared, self.namespaces, malformed, counted)

    def handle(self, client: Client, request: P.Request) -> tuple[Any, tuple[int, ...]]:
        """The reply to one request, and the descriptors it passes (a hello's only)."""
        self.counters.saw(request)
        if isinstance(request, P.Hello):
            return self._sessions.hello(client, request)
        answer = self._answers.get(type(request))
        if answer is None:
            raise KVStoreError(f"unknown request {type(request).__name__}")
        return answer(client, request), ()

    def _finished(self, client: Client, request: P.Finished) -> None:
        self.next_turns.finished(request.ranks)
        store = self.shared.store
        if store is not None and request.answer_tokens is not None:  # how it ended: admission learns
            store.finished(request.ranks, RequestEnd(request.answer_tokens, request.turn, request.idle_s))

    def _namespaces(self, client: Client, request: P.Announce | P.Namespaces | P.Purge) -> Any:
        return self.namespaces.handle(P.peer_credentials(client.channel.sock)[1], self.shared.store, request)

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
        """A client left (or died): its session ends (Sessions.forget)."""
        self._sessions.forget(client)

    def close(self) -> None:
        """Predictions and prefetches stopped, then the store closed (drained, checkpointed)."""
        self.next_turns.close()
        self.namespaces.close()
        self._prefetches.close()
        self.shared.close()
