"""Who gets one of the service's client slots, and the count of who did not.

Each connection holds a thread (and, once it says hello with a chunk size, a window), so
the service serves at most `service.max_clients` at once. Without shares, one allowed
user (`service.allowed_uids` / `allowed_gids`) that opened that many connections left the
service's own engines none: every new engine and every reconnect was refused, and
engines drifted to all-miss. So each uid other than the service's own holds at most
`service.max_clients_per_user`, and the other users together leave
`service.owner_reserved_clients` for the service's own uid; uids the config does not
allow get none. A refusal, and a connection the server closes because it said no hello
in time, is counted by reason as `clients.REASON` (`kvstore info`, Prometheus: every
reason shown from the start), the first of each reason logged as a warning and later
ones at debug level, so a user who keeps connecting cannot flood the log.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

from kvstore.config.store import ServiceConfig
from kvstore.format.malformed import KindCounts

REASONS = ("refused_not_allowed", "refused_full", "refused_user_share", "refused_owner_reserve",
           "hello_timeout")


class ClientSlots:
    """The slots held by uid, for the service running as uid `owner`. Thread-safe."""

    def __init__(self, service: ServiceConfig, owner: int, log: logging.Logger) -> None:
        self._service = service
        self._owner = owner
        self._allowed_uids = {owner, *service.allowed_uids}
        self._allowed_gids = set(service.allowed_gids)
        self._held: Counter[int] = Counter()
        self._others = 0  # slots held by uids other than the owner's
        self._lock = threading.Lock()
        self.counts = KindCounts(log, "clients", kinds=REASONS)  # shown with the service's own counters

    def take(self, uid: int, gid: int) -> str | None:
        """Take a slot for a connection of `uid` (in group `gid`): None if it got one, else
        why not, for the client (counted and logged)."""
        with self._lock:
            reason, why = self._refusal(uid, gid)
            if not reason:
                self._held[uid] += 1
                if uid != self._owner:
                    self._others += 1
                return None
        self.counts.add(reason, f"refused a client of uid {uid}: {why}", "connection refused")
        return why

    def give_back(self, uid: int) -> None:
        """The connection of `uid` that held a slot has ended."""
        with self._lock:
            self._held[uid] -= 1
            if not self._held[uid]:
                del self._held[uid]
            if uid != self._owner:
                self._others -= 1

    def hello_timeout(self, uid: int) -> None:
        """A connection of `uid` said no hello within `service.hello_timeout_s`: closed."""
        self.counts.add("hello_timeout", f"a client of uid {uid} said no hello within "
                        f"{self._service.hello_timeout_s:g} s (service.hello_timeout_s)", "connection closed")

    def _refusal(self, uid: int, gid: int) -> tuple[str, str]:
        """('', '') if `uid` may take a slot now, else the reason's name and its words."""
        service = self._service
        if uid not in self._allowed_uids and gid not in self._allowed_gids:
            return "refused_not_allowed", (f"uid {uid} is not allowed by this service "
                                           "(service.allowed_uids)")
        if uid != self._owner and self._held[uid] >= service.user_share:
            return "refused_user_share", (f"uid {uid} holds {service.user_share} connections already, "
                                          "its share (service.max_clients_per_user)")
        if uid != self._owner and self._others >= service.max_clients - service.owner_reserve:
            return "refused_owner_reserve", (
                f"other users hold {self._others} connections already, all but the "
                f"{service.owner_reserve} kept for the service's own user (service.owner_reserved_clients)")
        if sum(self._held.values()) >= service.max_clients:
            return "refused_full", (f"the service has {service.max_clients} clients already "
                                    "(service.max_clients)")
        return "", ""
