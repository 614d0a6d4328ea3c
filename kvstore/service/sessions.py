"""A client's session: what the service keeps for a connection, what its hello gives it,
and what its leaving takes back.

A hello must speak this service's protocol version, and its config must agree with the
service's on what both act on: not `service` (the service's own) nor the keys a SIGHUP
reload changes while engines run (LIVE_KEYS); a refusal names the keys that differ, never
their values (they may hold a password). A hello with a chunk size (a worker's) joins the
one store (shared_store.py, which makes it at the first) and is given a window of its own
(window.py) and, where service.share_dram lets its user, the DRAM tier to map. A hello
whose version or config does not agree, or that would make a second window, is a clear
error (KVStoreError, ConfigError) on that connection and gives it nothing.

Invariants: a connection has at most one window; the window is registered as a
direct-read region while it lives, and unmapped once no read that missed its deadline may
still land in it (Region.close); whatever way a client leaves (or dies), every DRAM lease
it holds goes back (client_leases.py, which states their invariants).
"""

from __future__ import annotations

from typing import Any

from kvstore.config.store import LIVE_KEYS, dump_config
from kvstore.format.errors import ConfigError, KVStoreError
from kvstore.io.regions import Region
from kvstore.service import protocol as P
from kvstore.service.client_leases import HeldLeases, LeaseDesk
from kvstore.service.shared_store import SharedStore
from kvstore.service.window import Window


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


class Sessions:
    """Opens a client's session at its hello and closes it when the client leaves."""

    def __init__(self, shared: SharedStore, leases: LeaseDesk) -> None:
        self._shared = shared
        self._leases = leases

    def hello(self, client: Client, hello: P.Hello) -> tuple[Any, tuple[int, ...]]:
        """The reply to a hello and the descriptors it passes: none for a hello without a
        chunk size (a scheduler's), the window's, and the DRAM tier's where it may map it."""
        shared = self._shared
        if hello.version != P.PROTOCOL_VERSION:
            raise KVStoreError(f"this client speaks protocol {hello.version}, the service at "
                               f"{shared.socket_path} speaks {P.PROTOCOL_VERSION}: restart it with "
                               "the same kvstore version (kvstore stop)")
        differ = disagreement(dump_config(shared.config), hello.config)
        if differ:
            raise ConfigError("service.socket", shared.socket_path,
                              f"a kvstore service with another config listens there (they differ in "
                              f"{', '.join(k[:64] for k in differ[:16])}); stop it (kvstore stop) or "
                              "use another socket")
        if hello.chunk_bytes is None:
            return None, ()
        client.namespace = hello.namespace
        if client.window is not None:
            raise KVStoreError("this connection has a window already")
        store = shared.join(client.uid, hello.chunk_bytes, hello)
        slots = max(1, shared.config.service.staging // hello.chunk_bytes)
        window, fd = Window.make(slots * hello.chunk_bytes)
        client.window, client.slots = window, slots
        client.region = store.regions.add(window.address, window.nbytes, window)
        reply = {"slots": slots, "window_bytes": window.nbytes, "pages": window.pages}
        tier = store.shared_dram.share() if shared.may_map_dram(client.uid) else None
        if tier is None:
            return reply, (fd,)
        tier_fd, tier_bytes, tier_pages = tier
        client.maps_tier = True
        return {**reply, "tier_bytes": tier_bytes, "tier_pages": tier_pages}, (fd, tier_fd)

    def forget(self, client: Client) -> None:
        """A client left (or died): its leases go back, and its window, unmapped once no
        late read may still land in it."""
        self._leases.release_all(self._shared.store, client.held)
        if client.region is not None:
            self._shared.unregister(client.region)
        if client.window is not None:
            if client.region is not None:
                client.region.close(client.window.close)
            else:
                client.window.close()
