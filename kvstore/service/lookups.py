"""What an engine's scheduler asks of the store about its requests and tells it of them:
Residency (how much of a prompt is stored, and in DRAM), Finished and Expect (when a chain
will be wanted again), and the promotions to DRAM they start.

A residency request covers every tensor-parallel rank's keys and is answered as one
snapshot (prefetches.py, which runs the promotions it asks for, one at a time); the
counters and lease releases it carries are taken first, so a lookup is one round trip.
With `lease_from` it also leases the DRAM run from that chunk on for the client's engine
workers, who copy it with no request of their own (client_leases.py). Requests arriving
and ending feed next-turn prediction (next_turns.py), whose promotions go through the same
queue; how a request ended feeds `learned` disk admission.

Invariants: before there is a store a lookup finds nothing ([0, 0, False]) and leases
nothing; a lookup leases only where the client's user may map the DRAM tier
(service.share_dram) and within that user's budget, DRAM only, never a disk read; a
counter name a client may not add is a clear error (KVStoreError) before anything of its
lookup is done; after `close` nothing more is predicted or promoted.
"""

from __future__ import annotations

from typing import Any

from kvstore.service import protocol as P
from kvstore.service.client_leases import LeaseDesk
from kvstore.service.counters import ClientCounters
from kvstore.service.next_turns import NextTurns
from kvstore.service.prefetches import Prefetches
from kvstore.service.sessions import Client
from kvstore.service.shared_store import SharedStore
from kvstore.tiers.return_rates import RequestEnd


class Lookups:
    """Answers Residency, Finished and Expect, and runs the promotions they start."""

    def __init__(self, shared: SharedStore, leases: LeaseDesk, counters: ClientCounters) -> None:
        self._shared = shared
        self._leases = leases
        self._counters = counters
        self._prefetches = Prefetches()  # promotions to DRAM, one at a time
        config = shared.config
        self._next_turns = NextTurns(config.next_turn, config.next_turn_lead_s, self._promote)

    def residency(self, client: Client, request: P.Residency) -> list[Any]:
        """One prompt's residency snapshot, after the counters and releases the request carries;
        with `lease_from`, the leading chunks every rank has in DRAM from that one on leased
        for the client's engine workers (client_leases.py: the lookup that decides a load
        protects it, and they copy with no request of their own), where the client may map
        the tier."""
        store = self._shared.store
        self._counters.add(store, request.counters, client.uid)
        for number in request.release:
            self._leases.release(store, client.held, number, read=True)
        for number in request.unread:
            self._leases.release(store, client.held, number)
        self._next_turns.arrived(request.ranks)
        found: list[Any] = [0, 0, False]
        if store is not None and request.ranks:
            found = self._prefetches.residency(store, request.ranks, request.prefetch, request.await_s,
                                               client.uid)
        if request.lease_from is None:
            return found
        if store is None or not self._shared.may_map_dram(client.uid):
            return [*found, 0, []]
        return found + self._leases.lease_run(store, client.held, request.ranks, request.lease_from,
                                              int(found[1]))

    def finished(self, request: P.Finished, uid: int) -> None:
        """A request's chunks (per rank) ended (a client of `uid` says): its next turn is
        expected; how it ended, where the client tells it, is what `learned` admission learns from."""
        self._next_turns.finished(request.ranks, uid)
        store = self._shared.store
        if store is not None and request.answer_tokens is not None:
            store.finished(request.ranks, RequestEnd(request.answer_tokens, request.turn, request.idle_s))

    def expect(self, request: P.Expect, uid: int) -> None:
        """A hint (from a client of `uid`): these chains are wanted in `in_s` seconds."""
        self._next_turns.expect(request.ranks, request.in_s, uid)

    def _promote(self, keys: tuple[bytes, ...], uid: int | None) -> None:
        """A chain next-turn prediction wants in DRAM now (for a client of `uid`, whose
        turn its promotion waits in)."""
        store = self._shared.store
        if store is not None:
            self._prefetches.promote(store, keys, uid)

    def close(self) -> None:
        """Predictions stopped, then the queued promotions dropped and the running one finished."""
        self._next_turns.close()
        self._prefetches.close()
