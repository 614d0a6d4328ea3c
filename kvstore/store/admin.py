"""The store's administration: what the service's owner and its control plane do to a
running store, beside the engines' requests (`TieredStore.admin`).

A purge of namespaces (the owner's `kvstore purge`), a config reload's live policy keys (the
service's SIGHUP) and `learned` admission's state carried from one service process to the
next (service/learned_file.py). None of it is on an engine's request path: an engine asks
the store for chunks, never for these.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from kvstore.store.edge import check_keys
from kvstore.store.parts import StoreParts
from kvstore.store.purge import purge


class StoreAdmin:
    """Changes to a running store that no request makes: records removed by namespace, the
    policy a reload changes, what `learned` admission learned. It exists so that the
    engines' face of the store (TieredStore) holds only what a request does, and so that
    a reader of the service sees where an owner's operation reaches the store.
    Invariants: a purge removes only records whose header names an asked namespace, and
    removes them as `TieredStore.delete` does (on disk too: a restart does not revive
    them); a reload changes later decisions only, every chunk a tier holds stays; a
    learned state is taken over whole or refused (ValueError), never in part."""

    def __init__(self, parts: StoreParts, delete: Callable[[list[bytes]], int]) -> None:
        """`delete`: the store's (TieredStore.delete), the one way a record leaves every tier."""
        self._parts = parts
        self._delete = delete

    def purge(self, namespaces: Collection[bytes], dry_run: bool = False) -> dict[str, int]:
        """Remove every record whose header names one of `namespaces` from every tier of
        this host (store/purge.py); a dry run only counts them."""
        return purge(self._parts, self._delete, set(check_keys(list(namespaces))), dry_run)

    def purges_pending(self) -> list[bytes]:
        """The namespaces a purge could not reach everywhere: a disk device out of service
        holds records of theirs, zeroed when it comes back (tiers/availability.py)."""
        disk = self._parts.disk
        return disk.availability.pending_namespaces() if disk is not None else []

    def reload_policy(self, live: Mapping[str, Any]) -> None:
        """Apply the live keys a config reload changed (config.store.LIVE_KEYS): admission,
        eviction and the write budget change; every chunk a tier holds stays."""
        self._parts.reload_policy(live)

    def learned_admission(self, restore: object = None) -> dict[str, Any] | None:
        """What `learned` disk admission has learned, for a later process (None: another
        policy); `restore`, an earlier one's, is taken over first (ValueError: it does not check)."""
        return self._parts.policy.learned_state(restore)
