"""Faults, clocks and stray writes a test sets inside a running TieredStore.

The one module of tests/ that reaches into a store's parts (kvstore/store/parts.py): a
fault is injected where the store keeps what it breaks (a device's descriptor, the
monitor's clock, a DRAM slot's bytes, a peer's lease), so each is named here once, and
every test reads state through the store's front and its `probe` (tests/house_rules.py
holds the rest of tests/ to that).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvstore.cluster.index import PeerHit
from kvstore.cluster.peer_devices import PeerDevice
from kvstore.cluster.publisher import IndexPublisher
from kvstore.devices.health import OFFLINE
from kvstore.io.base import IoRequest
from kvstore.service.client import StoreClient
from kvstore.service.protocol import ProtocolError
from kvstore.store.tiered import TieredStore


def on_device(store: TieredStore, group: int) -> Callable[[IoRequest], bool]:
    """A FaultyEngine fault's `match`: the I/O to this host's disk device `group`."""
    assert store.parts.disk is not None
    fd = store.parts.disk.devices[group].fd
    return lambda request: request.fd == fd


def peer_devices(store: TieredStore) -> list[PeerDevice]:
    """The peers' devices this host reads (their `fd` for a fault's match, their health)."""
    assert store.parts.cluster is not None
    return list(store.parts.cluster.devices)


def monitor_clock(store: TieredStore, clock: Callable[[], float]) -> None:
    """The health monitor's clock (its breakers' cooldowns), moved on by the test."""
    assert store.parts.monitor is not None
    store.parts.monitor.clock = clock


def policy_clock(store: TieredStore, clock: Callable[[], float]) -> None:
    """The policy's clock (a write budget's allowance, learned admission's departures)."""
    store.parts.policy.clock = clock


def controller_lost(store: TieredStore, group: int, reason: str) -> None:
    """Device `group` leaves service now, as when its NVMe-oF controller is lost."""
    assert store.parts.disk is not None
    store.parts.disk.availability.take_out(group, OFFLINE, reason)


def revalidate(store: TieredStore, group: int) -> bool:
    """Bring device `group` back now, as the monitor does once its probe passes."""
    assert store.parts.disk is not None
    return store.parts.disk.availability.revalidate(group)


def stray_write(store: TieredStore, key: bytes, start: int, data: bytes) -> None:
    """Bytes written into the DRAM slot holding `key` by something that is not the store."""
    assert store.parts.dram is not None
    slot = store.parts.dram.table.find(key)
    assert slot is not None, "the key is not in DRAM"
    store.parts.dram.slot_view(slot)[start : start + len(data)] = data


def lose_from_dram(store: TieredStore, key: bytes) -> None:
    """`key` leaves DRAM without being written down (as an eviction the policy refused)."""
    assert store.parts.dram is not None
    store.parts.dram.table.unpublish(key)


def disk_offset(store: TieredStore, slot: int) -> int:
    """Where disk slot `slot` starts in its device (to corrupt or zero it from outside)."""
    assert store.parts.disk is not None
    return store.parts.disk.locate(slot)[1]


def publisher(store: TieredStore) -> IndexPublisher:
    """This host's publisher of its chunks to the cluster index (its lease, its thread)."""
    assert store.parts.cluster is not None and store.parts.cluster.publisher is not None
    return store.parts.cluster.publisher


def eviction_keys(store: TieredStore) -> set[bytes]:
    """The keys the disk tier's eviction order holds (it must hold exactly what the tier does)."""
    assert store.parts.disk is not None
    return set(store.parts.disk.table.eviction)


def index_writes_slow(store: TieredStore, seconds: float) -> None:
    """Each batch of chunk entries this host's publisher sends to the index takes `seconds`
    longer (a loaded Redis, a shard that answers at its deadline); the lease's own SET does not."""
    index = publisher(store)._index
    run = index.run

    def slow(commands):
        if any(name != "set" for name, _ in commands):
            time.sleep(seconds)
        return run(commands)

    index.run = slow  # type: ignore[method-assign]


def next_reply_not_a_frame(client: StoreClient) -> None:
    """The client's next reply is not a frame of the protocol (a live service's bug, bytes
    lost on the socket): its channel raises ProtocolError, as it does for one."""
    channel = client._conn._channel
    assert channel is not None
    recv = channel.recv

    def garbled(*args, **kwargs):
        channel.recv = recv  # once
        raise ProtocolError("not a message of this protocol: a frame garbled on purpose")

    channel.recv = garbled  # type: ignore[method-assign]


def renewal_due(store: TieredStore) -> None:
    """The publisher's lease renewal is due now (it renews every lease_s / 3)."""
    publisher(store)._renewed = 0.0


def look_for_peer_devices(store: TieredStore) -> None:
    """What the peers' monitor thread does once: open the devices that exist now, check the rest."""
    assert store.parts.cluster is not None
    store.parts.cluster.devices.check_once()


def index_locate(store: TieredStore, keys: list[bytes]) -> dict[bytes, list[PeerHit]] | None:
    """The cluster index's answer for `keys`, uncached (None: the index failed)."""
    assert store.parts.cluster is not None
    return store.parts.cluster.index.locate(keys)


def awaiting_fails(store: TieredStore, error: Exception | None) -> None:
    """The cluster index reads for awaited chunks (off the lookups' path) raise `error`
    (a bug, an answer of a kind never seen); None: they read the index again."""
    assert store.parts.cluster is not None
    index = store.parts.cluster.index
    read = type(index).locate.__get__(index)

    def locate(keys: list[bytes], backoff: bool = True) -> dict[bytes, list[PeerHit]] | None:
        if error is not None and not backoff:
            raise error
        return read(keys, backoff)

    index.locate = locate  # type: ignore[method-assign]


def disk_reads_raise(store: TieredStore, monkeypatch: Any, error: BaseException) -> None:
    """Every disk read of this store raises `error` (an io_uring that cannot be set up on
    a new thread), until the test's monkeypatch is undone."""
    def fails(*args: Any, **kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(store.parts.reader, "read", fails)


def being_deleted(store: TieredStore, key: bytes) -> bool:
    """Whether a delete of `key` is under way in this store (copies_in_flight.py)."""
    return store.parts.in_flight.being_deleted(key)


def reads_raise_after_the_disk(store: TieredStore, monkeypatch: Any, error: BaseException) -> None:
    """The read path raises once its disk reads have landed (in the policy's bookkeeping of
    what was read), until the test's monkeypatch is undone."""
    def fails(*args: Any, **kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(store.parts.policy, "seen", fails)
