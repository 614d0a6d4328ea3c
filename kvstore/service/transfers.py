"""Chunks moving between a client and the store: Get and Put through the client's window,
Pin and Unpin for a client that copies chunks out of the mapped DRAM tier itself (a Pin
may carry the Unpin of the waves copied before it, done first: done even where the pin
then fails its checks, as the client drops its connection on any error anyway).

What a request names is checked against the client's session before the store sees any
of it: the store must be made and the connection must have a window (a hello with a
chunk size); a Get's or Put's keys and window slots must pair up, each slot inside the
window; a Pin needs the DRAM tier mapped (service.share_dram). What does not check is a
clear error reply (KVStoreError) saying what was wrong, and nothing of it is done. A
chunk a Get or Pin asks for that is not stored or does not verify is a miss in the answer
(False, offset -1), counted by the store, never an error. Invariants: a put's namespace is marked as being
stored while it runs, so the namespace book does not forget it meanwhile (namespaces.py);
a client's pins together cover at most its window's slots, and an Unpin gives back only
leases this client holds (client_leases.py).
"""

from __future__ import annotations

from typing import Any

from kvstore.format.errors import KVStoreError
from kvstore.service import protocol as P
from kvstore.service.client_leases import LeaseDesk
from kvstore.service.namespaces import NamespaceBook
from kvstore.service.sessions import Client
from kvstore.service.shared_store import SharedStore
from kvstore.store.tiered import TieredStore


class Transfers:
    """Answers Get, Put, Pin and Unpin."""

    def __init__(self, shared: SharedStore, leases: LeaseDesk, namespaces: NamespaceBook) -> None:
        self._shared = shared
        self._leases = leases
        self._namespaces = namespaces

    def get(self, client: Client, request: P.Get) -> list[bool]:
        store, views = self._views(client, request)
        return store.get_many(request.keys, views)

    def put(self, client: Client, request: P.Put) -> list[bool]:
        store, views = self._views(client, request)
        namespace = request.namespace or client.namespace
        with self._namespaces.storing(namespace):  # its records are not forgotten meanwhile
            return store.put_many(request.keys, views, request.parent, namespace)

    def pin(self, client: Client, request: P.Pin) -> list[Any]:
        store = self._shared.store
        if store is None or client.window is None:
            raise KVStoreError("'Pin' needs a hello with a chunk size first")
        if not client.maps_tier:
            raise KVStoreError("this connection was not given the DRAM tier (service.share_dram): "
                               "load through the window")
        if request.unpin is not None:  # before the pin: those pins no longer count against the window
            self.unpin(client, request.unpin)
        return self._leases.pin(store, client.held, request.keys, request.verify, client.slots)

    def unpin(self, client: Client, request: P.Unpin) -> None:
        good, bad = set(request.good), set(request.bad)
        for number in request.leases:
            self._leases.release(self._shared.store, client.held, number, good, bad)

    def _views(self, client: Client, request: P.Get | P.Put) -> tuple[TieredStore, list[memoryview]]:
        """The store and the window slots a Get or Put names, checked."""
        store, window = self._shared.store, client.window
        if store is None or window is None:
            raise KVStoreError(f"'{type(request).__name__}' needs a hello with a chunk size first")
        size = store.chunk_bytes
        if len(request.keys) != len(request.slots) or any(not 0 <= s < client.slots for s in request.slots):
            raise KVStoreError(f"bad window slots {request.slots} for {len(request.keys)} keys "
                               f"(the window has {client.slots})")
        return store, [window.view[s * size : (s + 1) * size] for s in request.slots]
