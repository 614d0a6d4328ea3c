"""The service's requests: a table from each request kind to the part whose job it is,
and the parts' life together (made at start, told when a client leaves, closed in order).

The parts, each stating its own invariants:
  shared_store.py  the one store every client shares (made at the first hello with a
                   chunk size from the service's own user) and the config it runs with
  sessions.py      Hello, and a client's leaving: its window, its leases
  transfers.py     Get, Put, Pin, Unpin: chunks moving between a client and the store
  lookups.py       Residency, Finished, Expect: what a scheduler asks and tells of its
                   requests, and the promotions to DRAM they start
  counters.py      Info, Count: what clients add and what the service counts of its own
  namespaces.py    Announce, Namespaces, Purge (the last two the service's owner's only)
  chunk_events.py  Events: chunks entering and leaving each tier, for routers

A request's fields are bounded where its frame is decoded (protocol.py); what its body
names is checked by the part that answers it, against what that part holds (a client's
window, the store), so no check reads another part's state. What does not check is a
KVStoreError, which the server sends back as an error reply on that connection; a chunk
not found is a miss in the answer, counted by the store; any other exception is a bug the
server logs and answers as an error, never the end of the service's thread.
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
from kvstore.service.lookups import Lookups
from kvstore.service.namespaces import NamespaceBook
from kvstore.service.sessions import Client, Sessions
from kvstore.service.shared_store import SharedStore
from kvstore.service.transfers import Transfers

log = logging.getLogger(__name__)


class Requests:
    """Answers clients' requests, each kind by the part whose job it is (`_answers`); a
    hello, which may pass descriptors, is the one answered apart. Invariants: every request
    is counted by kind (`requests.KIND`) before it is answered; a kind with no answer is a
    KVStoreError; at close, predictions and promotions stop first, then the namespace book,
    and the store closes last."""

    def __init__(self, config: StoreConfig, socket_path: str, counted: tuple[KindCounts, ...] = ()) -> None:
        malformed = MalformedCounts(log)  # frames, reloads, counter names: the service's own
        events = ChunkEvents()  # what engines tell routers
        self.shared = SharedStore(config, socket_path, events, malformed)
        self._namespaces = NamespaceBook(socket_path + ".namespaces", malformed, self.shared.namespaces,
                                         self.shared.purge)
        self.counters = ServiceCounters(self.shared, self._namespaces, malformed, counted)
        leases = LeaseDesk(config.service.scheduler_leases)  # every client's DRAM leases
        self._sessions = Sessions(self.shared, leases)
        self._lookups = Lookups(self.shared, leases, self.counters.clients)
        transfers = Transfers(self.shared, leases, self._namespaces)
        self._answers: dict[type, Callable[[Client, Any], Any]] = {
            P.Residency: self._lookups.residency,
            P.Finished: lambda client, request: self._lookups.finished(request, client.uid),
            P.Expect: lambda client, request: self._lookups.expect(request, client.uid),
            P.Get: transfers.get, P.Put: transfers.put, P.Pin: transfers.pin, P.Unpin: transfers.unpin,
            P.Info: lambda client, request: self.counters.info(),
            P.Count: lambda client, request: self.counters.clients.add(self.shared.store, request.counters,
                                                                        client.uid),
            P.Events: lambda client, request: events.since(request.since),
            P.Announce: self._namespace_request, P.Namespaces: self._namespace_request,
            P.Purge: self._namespace_request}
        self._namespaces.start()

    def handle(self, client: Client, request: P.Request) -> tuple[Any, tuple[int, ...]]:
        """The reply to one request, and the descriptors it passes (a hello's only)."""
        self.counters.saw(request)
        if isinstance(request, P.Hello):
            return self._sessions.hello(client, request)
        answer = self._answers.get(type(request))
        if answer is None:
            raise KVStoreError(f"unknown request {type(request).__name__}")
        return answer(client, request), ()

    def _namespace_request(self, client: Client, request: P.Announce | P.Namespaces | P.Purge) -> Any:
        """The book answers with the uid at the other end (SO_PEERCRED): listing and purging
        are the service's owner's."""
        return self._namespaces.handle(P.peer_credentials(client.channel.sock)[1], request)

    def forget(self, client: Client) -> None:
        """A client left (or died): its session ends (Sessions.forget)."""
        self._sessions.forget(client)

    def close(self) -> None:
        """Predictions and promotions stopped, the namespace book written, then the store
        closed (drained, checkpointed)."""
        self._lookups.close()
        self._namespaces.close()
        self.shared.close()
