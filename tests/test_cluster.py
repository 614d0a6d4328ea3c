"""Several hosts, one array: two real services (each its own device and host id) share
chunks through a real redis-server, and a stale index, a stopped host, a dead device or
a lost index costs misses, never wrong bytes or a hang."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pytest
from support import faults
from support.cluster import (
    CHUNK,
    DEADLINE_S,
    LEASE_S,
    SLOTS,
    client,
    found,
    get,
    host_config,
    put,
    wait_for,
)
from support.services import counters, stop_service
from support.stalls import stall_meter
from support.stores import attached, make_keys, make_payloads, read_back, reads_back

from bench.support.loopdev import LoopDevices
from kvstore.cluster import node as node_module
from kvstore.cluster import publisher as publisher_module
from kvstore.devices.layout import SB_COPIES
from kvstore.format.errors import ConfigError
from kvstore.format.record import BLOCK, record_bytes
from kvstore.io import make_engine
from kvstore.io.faulty import Fault, FaultyEngine
from kvstore.store.fsck import fsck
from kvstore.store.tiered import TieredStore

redis = pytest.importorskip("redis", reason="the redis client is not installed (pip install -e .)")

@pytest.fixture
def hosts(tmp_path, disk_dir, redis_server):
    """Host A's and host B's configs (each reads the other's device); their services stop
    after the test."""
    configs = {name: host_config(name, [other], disk_dir, redis_server.url, sockets=str(tmp_path))
               for name, other in (("a", "b"), ("b", "a"))}
    yield configs
    for config in configs.values():
        stop_service(config)


def index_entry(url: str, key: bytes, host: str) -> bytes | None:
    with redis.Redis.from_url(url) as r:
        return r.hget(b"kvstore:c:" + key, host)


def set_index_entry(url: str, key: bytes, host: str, raw: bytes) -> None:
    with redis.Redis.from_url(url) as r:
        r.hset(b"kvstore:c:" + key, host, raw)


def test_b_loads_chunks_only_a_wrote(hosts):
    a, b = client(hosts["a"]), client(hosts["b"])
    keys, payloads = make_keys(SLOTS), make_payloads(SLOTS, chunk_bytes=CHUNK)
    assert put(a, keys, payloads) == [True] * SLOTS
    wait_for(lambda: found(b, keys) == SLOTS, what="B finding A's chunks")
    ok, data = get(b, keys)
    assert ok == [True] * SLOTS
    assert data == [p.tobytes() for p in payloads]
    read = counters(hosts["b"])
    assert read["peer.hits"] == SLOTS and read["get.hits"] == SLOTS
    info = b.info()
    assert info["tiers"][0]["chunks"] == 0  # B's own device holds nothing: it read A's
    (device,) = info["cluster"]["peer_devices"]
    assert (device["host"], device["state"]) == ("a", "in_service")
    assert "peer.hits" not in counters(hosts["a"])


def test_an_overwritten_slot_or_a_stale_entry_is_a_miss_never_wrong_bytes(hosts, redis_server):
    a, b = client(hosts["a"]), client(hosts["b"])
    first, second = make_keys(SLOTS, seed=1), make_keys(SLOTS, seed=2)
    payloads = make_payloads(SLOTS, seed=2, chunk_bytes=CHUNK)
    assert put(a, first, make_payloads(SLOTS, seed=1, chunk_bytes=CHUNK)) == [True] * SLOTS
    wait_for(lambda: found(b, first) == SLOTS, what="B finding A's chunks")
    old = index_entry(redis_server.url, first[0], "a")
    assert old is not None
    assert put(a, second, payloads) == [True] * SLOTS  # A's 4 slots now hold other chunks
    wait_for(lambda: index_entry(redis_server.url, first[0], "a") is None, what="A withdrawing")
    # The withdrawal is lost (as if Redis had missed it): B is pointed at a reused slot.
    set_index_entry(redis_server.url, first[0], "a", old)
    time.sleep(1.1)  # past B's memory of earlier answers (kvstore.cluster.node.RECENT_S)
    assert get(b, first[:1])[0] == [False]
    assert counters(hosts["b"])["peer.miss.wrong_key"] == 1
    # The right key, but not the copy the entry names (seq differs): also a miss.
    from kvstore.cluster.index import Location

    raw = index_entry(redis_server.url, second[0], "a")
    location = Location.unpack(raw)
    set_index_entry(redis_server.url, second[0], "a",
                    dataclasses.replace(location, seq=location.seq + 1).pack())
    assert get(b, second[:1])[0] == [False]
    assert counters(hosts["b"])["peer.miss.stale"] == 1
    set_index_entry(redis_server.url, second[0], "a", raw)  # the true entry: served
    ok, data = get(b, second[:1])
    assert ok == [True] and data[0] == payloads[0].tobytes()


def test_a_stopped_host_is_ignored_once_its_lease_expires(hosts):
    a, b = client(hosts["a"]), client(hosts["b"])
    keys, payloads = make_keys(SLOTS, seed=3), make_payloads(SLOTS, seed=3, chunk_bytes=CHUNK)
    assert put(a, keys, payloads) == [True] * SLOTS
    wait_for(lambda: found(b, keys) == SLOTS, what="B finding A's chunks")
    pid = a.info()["service_pid"]
    a.close()
    os.kill(pid, signal.SIGKILL)  # no clean stop: its lease is not withdrawn, it runs out
    killed = time.monotonic()
    wait_for(lambda: found(b, keys) == 0, timeout_s=LEASE_S + 3, what="B ignoring A")
    assert time.monotonic() - killed < LEASE_S + 2
    assert get(b, keys)[0] == [False] * SLOTS
    assert counters(hosts["b"]).get("peer.index_expired", 0) > 0
    assert fsck(hosts["a"]["tiers"]["disk"][0]["path"])["valid"] == SLOTS  # the records are intact
    # A restarts: it recovers its device and publishes it under a new lease.
    a = client(hosts["a"])
    wait_for(lambda: found(b, keys) == SLOTS, what="B finding the restarted A's chunks")
    ok, data = get(b, keys)
    assert ok == [True] * SLOTS and data == [p.tobytes() for p in payloads]


def test_with_the_index_paused_or_down_both_serve_their_own_in_time(hosts, redis_server, tmp_path):
    """Each lookup within the index deadline, less any time the machine stalled (a CI run
    shares 2 cores with engine servers): the client's own time, not a redis timeout."""
    a, b = client(hosts["a"]), client(hosts["b"])
    own_a, own_b, unknown = make_keys(2, seed=4), make_keys(2, seed=5), make_keys(2, seed=6)
    assert put(a, own_a, make_payloads(2, seed=4, chunk_bytes=CHUNK)) == [True, True]
    assert put(b, own_b, make_payloads(2, seed=5, chunk_bytes=CHUNK)) == [True, True]
    wait_for(lambda: found(b, own_a) == 2, what="B finding A's chunks")
    with stall_meter(tmp_path) as meter:
        for outage in (redis_server.pause, redis_server.stop):
            outage()
            for store, own in ((a, own_a), (b, own_b)):
                for _ in range(3):  # the first pays the deadline; the next skip the index
                    count, seconds, stalled = meter.timed(lambda: found(store, own + unknown))  # noqa: B023
                    assert count == 2 and seconds - stalled < DEADLINE_S + 0.3
                assert get(store, own)[0] == [True, True]
            time.sleep(1.1)  # past B's memory of earlier answers (kvstore.cluster.node.RECENT_S)
            count, seconds, stalled = meter.timed(lambda: found(b, own_a))
            assert count == 0 and seconds - stalled < DEADLINE_S + 0.3  # no index, no answer; a miss in time
            if outage == redis_server.pause:
                redis_server.resume()
                time.sleep(0.5)
    assert counters(hosts["b"])["peer.index_errors"] >= 2
    # An empty index comes back: each host publishes what its device holds again.
    redis_server.restart()
    wait_for(lambda: found(b, own_a) == 2, what="A's chunks back in the new index")
    assert get(b, own_a)[0] == [True, True]


def test_awaited_chunks_are_found_while_lookups_skip_the_index(tmp_path, disk_dir, redis_server):
    """A consumer holds a request until chunks a producer is storing are readable (the
    prefill/decode handoff). After an index read that failed, B's lookups skip the index
    (here for a minute): they would not see A's chunks published meanwhile before the hold
    ran out. Awaited, the chunks are looked for past that, and B's next lookup finds them."""
    configs = {name: host_config(name, [other], disk_dir, redis_server.url, sockets=str(tmp_path))
               for name, other in (("a", "b"), ("b", "a"))}
    configs["b"]["cluster"]["index_backoff_s"] = 60.0
    try:
        a, b = client(configs["a"]), client(configs["b"])
        keys, payloads = make_keys(SLOTS, seed=7), make_payloads(SLOTS, seed=7, chunk_bytes=CHUNK)
        redis_server.pause()
        assert found(b, keys) == 0  # the read fails: B's lookups skip the index from now on
        redis_server.resume()
        assert put(a, keys, payloads) == [True] * SLOTS
        wait_for(lambda: all(index_entry(redis_server.url, key, "a") for key in keys), what="A publishing")
        assert found(b, keys) == 0  # in the index, but B's lookups do not ask it
        assert b.residency_ranks([keys], await_s=10.0)[0] == 0  # held for them: B awaits them
        wait_for(lambda: found(b, keys) == SLOTS, timeout_s=5, what="B finding the awaited chunks")
        ok, data = get(b, keys)
        assert ok == [True] * SLOTS and data == [p.tobytes() for p in payloads]
        assert counters(configs["b"])["peer.index_skipped"] >= 2
    finally:
        for config in configs.values():
            stop_service(config)


def _store_pair(root: str, url: str, **b_options) -> tuple[TieredStore, TieredStore]:
    a = TieredStore(host_config("a", ["b"], root, url), CHUNK, background=False)
    b = TieredStore(host_config("b", ["a"], root, url, **b_options.pop("config", {})), CHUNK,
                    background=False, **b_options)
    return a, b


def _found_once_written(a: TieredStore, b: TieredStore, keys: list[bytes], payloads: list) -> None:
    """A writes `keys` down to its disk; B, which awaits them, finds and reads them back."""
    a.put_many(keys, payloads)
    a.step()
    wait_for(lambda: b.lookup(keys).count == len(keys), timeout_s=5, what="B finding A's chunks")
    assert reads_back(b, keys, payloads)


def test_a_failing_round_of_awaiting_ends_neither_the_awaiting_nor_a_lookup(disk_dir, redis_server):
    a, b = _store_pair(disk_dir, redis_server.url)
    try:
        keys, payloads = make_keys(SLOTS, seed=9), make_payloads(SLOTS, seed=9, chunk_bytes=CHUNK)
        faults.awaiting_fails(b, RuntimeError("an answer of a kind never seen"))
        assert b.lookup(keys, await_s=10.0).count == 0  # answered; the awaiting rounds fail
        time.sleep(0.2)  # several rounds
        faults.awaiting_fails(b, None)
        assert [t.name for t in threading.enumerate()].count("kvstore-awaited") >= 1
        _found_once_written(a, b, keys, payloads)
    finally:
        a.close()
        b.close()


def test_a_co_tenant_awaits_at_most_its_share_and_never_cuts_the_owners_awaits_short(
        disk_dir, redis_server, monkeypatch):
    """Awaited chunks are bounded for the host; a user other than the service's own holds at
    most a quarter of the bound, so a co-tenant awaiting chunks no one will publish cannot
    leave the owner's prefill/decode handoff unwatched."""
    monkeypatch.setattr(node_module, "AWAITED_LIMIT", 8)
    a, b = _store_pair(disk_dir, redis_server.url)
    try:
        co_tenant = os.geteuid() + 1000
        assert b.lookup(make_keys(8, seed=11), await_s=10.0, uid=co_tenant).count == 0
        assert b.stats.snapshot()["peer.await_dropped"] == 6  # its quarter: 2 of 8 awaited
        keys, payloads = make_keys(SLOTS, seed=12), make_payloads(SLOTS, seed=12, chunk_bytes=CHUNK)
        assert b.lookup(keys, await_s=10.0).count == 0
        assert b.stats.snapshot()["peer.await_dropped"] == 6  # the owner's all awaited
        _found_once_written(a, b, keys, payloads)
    finally:
        a.close()
        b.close()


def test_peer_chunks_promote_into_dram_but_never_onto_this_hosts_disk(disk_dir, redis_server):
    a, b = _store_pair(disk_dir, redis_server.url, config={"dram": f"{2 * record_bytes(CHUNK)}"})
    try:
        keys, payloads = make_keys(SLOTS, seed=7), make_payloads(SLOTS, seed=7, chunk_bytes=CHUNK)
        a.put_many(keys, payloads)
        a.step()
        assert b.lookup(keys).tiers == ("peer",) * SLOTS
        for _ in range(2):
            assert reads_back(b, keys, payloads)
        assert sorted(b.lookup(keys).tiers) == ["dram", "dram", "peer", "peer"]  # promoted, DRAM full
        b.put_many(make_keys(2, seed=8), make_payloads(2, seed=8, chunk_bytes=CHUNK))  # evicts them
        assert b.flush() and not b.probe.keys("disk")  # dropped, not written to B's disk
        assert "dram.demoted" not in b.stats.snapshot()
    finally:
        a.close()
        b.close()
    assert fsck(os.path.join(disk_dir, "b"))["valid"] == 2  # B's own two chunks, none of A's


def test_a_dead_peer_device_costs_one_deadline_then_misses(disk_dir, redis_server, tmp_path):
    engine = FaultyEngine(make_engine("threads", 8))
    a, b = _store_pair(disk_dir, redis_server.url, engine=engine, config={"io_timeout_s": 0.5})
    try:
        keys, payloads = make_keys(SLOTS, seed=9), make_payloads(SLOTS, seed=9, chunk_bytes=CHUNK)
        a.put_many(keys, payloads)
        a.step()
        (device,) = faults.peer_devices(b)
        engine.add(Fault("hang", match=lambda request: request.fd == device.fd))
        with stall_meter(tmp_path) as meter:
            (ok, _), seconds, stalled = meter.timed(lambda: read_back(b, keys))
        assert ok == [False] * SLOTS
        assert seconds > 0.4 and seconds - stalled < 1.5  # one deadline (io.timeout_s 0.5)
        assert device.health.state == "tripped"
        assert b.lookup(keys).count == 0  # its chunks no longer count as present
        injected = engine.injected
        assert read_back(b, keys)[0] == [False] * SLOTS
        assert engine.injected == injected  # no I/O at all: nothing reached the hanging device
        engine.clear()
        time.sleep(0.35)  # io.breaker_cooldown_s
        faults.look_for_peer_devices(b)  # what the monitor thread does
        assert device.health.state == "in_service"
        assert reads_back(b, keys, payloads)
    finally:
        engine.release()
        a.close()
        b.close()


def test_a_peer_device_whose_superblock_goes_is_out_until_it_reads_again(disk_dir, redis_server):
    """The watch re-reads a peer device's superblock (its owner may wipe or reformat it):
    unreadable, the device is out and its chunks miss without I/O; readable again, it serves."""
    a, b = _store_pair(disk_dir, redis_server.url)
    try:
        keys, payloads = make_keys(SLOTS, seed=10), make_payloads(SLOTS, seed=10, chunk_bytes=CHUNK)
        a.put_many(keys, payloads)
        a.step()
        (device,) = faults.peer_devices(b)
        path = device.path
        assert path is not None
        with open(path, "r+b") as f:
            superblocks = f.read(SB_COPIES * BLOCK)
            f.seek(0)
            f.write(bytes(len(superblocks)))
        faults.look_for_peer_devices(b)
        assert device.health.state == "offline" and "superblock" in device.health.reason
        assert b.lookup(keys).count == 0 and read_back(b, keys)[0] == [False] * SLOTS
        with open(path, "r+b") as f:
            f.write(superblocks)
        faults.look_for_peer_devices(b)
        assert device.health.state == "in_service"
        assert reads_back(b, keys, payloads)
    finally:
        a.close()
        b.close()


@pytest.mark.loopdev
def test_a_peers_raw_block_device_is_read_while_its_owner_holds_it(tmp_path, redis_server):
    """Raw block devices (loop devices standing in for two NVMe-oF namespaces): the owner
    opens its own O_EXCL with a flock; a peer's read-only open needs neither."""
    with attached(LoopDevices(str(tmp_path), 2, 8 << 20)) as loops:
        def config(me: int) -> dict:
            other = 1 - me
            return {"tiers": {"disk": [{"path": loops.devices[me], "capacity": "4MiB"}]},
                    "io": {"engine": "uring", "timeout_s": 5},
                    "cluster": {"host_id": f"h{me}", "index_url": redis_server.url,
                                "peers": [{"host_id": f"h{other}",
                                           "disk": [{"path": loops.devices[other], "capacity": "4MiB"}]}]}}

        a = TieredStore(config(0), CHUNK, background=False)
        b = TieredStore(config(1), CHUNK, background=False)
        try:
            keys, payloads = make_keys(8, seed=10), make_payloads(8, seed=10, chunk_bytes=CHUNK)
            assert a.put_many(keys, payloads) == [True] * 8
            a.step()
            assert reads_back(b, keys, payloads)
        finally:
            a.close()
            b.close()


def test_a_peer_device_that_is_this_hosts_own_is_refused(disk_dir):
    config = host_config("a", ["b"], disk_dir, "redis://127.0.0.1:1/0")
    config["cluster"]["peers"][0]["disk"][0]["path"] = os.path.join(disk_dir, "a")
    with pytest.raises(ConfigError, match=r"cluster\.peers\[0\]\.disk\[0\]\.path.*this host's own"):
        TieredStore(config, CHUNK, background=False)


def test_a_publish_longer_than_the_lease_renews_it_as_it_goes(disk_dir, redis_server, monkeypatch):
    """A reconcile of many chunks (here: a pipeline per chunk, each taking half the lease)
    runs past the lease: renewed only before it, the lease ran out midway, the next renewal
    found it gone and reconciled everything again, for ever, and peers lost the host's
    chunks each time. It is renewed between batches now."""
    monkeypatch.setattr(publisher_module, "_BATCH", 1)
    a = TieredStore(host_config("a", [], disk_dir, redis_server.url), CHUNK, background=False)
    try:
        a.put_many(make_keys(SLOTS, seed=12), make_payloads(SLOTS, seed=12, chunk_bytes=CHUNK))
        publisher = faults.publisher(a)
        faults.index_writes_slow(a, LEASE_S / 2)
        assert publisher.step()  # the start's reconcile: SLOTS batches, 2 x the lease
        assert a.stats.snapshot()["peer.reconciles"] == 1
        faults.renewal_due(a)
        assert publisher.step()
        assert a.stats.snapshot()["peer.reconciles"] == 1  # the lease lived: no reconcile again
    finally:
        a.close()


def test_a_publishing_step_that_fails_past_the_index_leaves_the_thread_publishing(disk_dir, redis_server,
                                                                                 monkeypatch):
    """A fault no index error explains (a bug) in one step: the thread logs it and goes on,
    reconciling; before, it ended for good, and the host's chunks left the index with its
    lease."""
    a = TieredStore(host_config("a", ["b"], disk_dir, redis_server.url), CHUNK)  # its threads run
    b = TieredStore(host_config("b", ["a"], disk_dir, redis_server.url), CHUNK, background=False)
    try:
        publisher = faults.publisher(a)
        wait_for(lambda: publisher.sent >= 1, timeout_s=10, what="A's first reconcile")
        send = publisher._send_queued
        failures = []

        def once() -> bool:
            if not failures:
                failures.append(1)
                raise RuntimeError("a fault of a kind never seen")
            return send()

        monkeypatch.setattr(publisher, "_send_queued", once)
        keys = make_keys(SLOTS, seed=15)
        a.put_many(keys, make_payloads(SLOTS, seed=15, chunk_bytes=CHUNK))
        wait_for(lambda: b.lookup(keys).count == SLOTS, timeout_s=10, what="B finding A's chunks")
        assert failures and [t.name for t in threading.enumerate()].count("kvstore-index") >= 1
    finally:
        a.close()
        b.close()


def test_a_write_the_index_refuses_is_counted_and_not_retried(disk_dir, redis_server):
    """A key of another type where a chunk's entry goes (another user of the same Redis,
    or a hostile one): that write is refused. It was taken for a failed shard, sent again
    at every step, and each step then waited the index backoff: publishing slowed for good."""
    a = TieredStore(host_config("a", [], disk_dir, redis_server.url), CHUNK, background=False)
    try:
        publisher = faults.publisher(a)
        assert publisher.step()
        keys = make_keys(2, seed=13)
        with redis.Redis.from_url(redis_server.url) as r:
            r.set(publisher.keys.chunk(keys[0]), b"not a hash")
        a.put_many(keys, make_payloads(2, seed=13, chunk_bytes=CHUNK))
        assert publisher.step()
        assert a.stats.snapshot()["peer.publish_refused"] == 1
        assert a.stats.snapshot().get("peer.publish_errors", 0) == 0
        a.put_many(make_keys(1, seed=14), make_payloads(1, seed=14, chunk_bytes=CHUNK))
        assert publisher.step() and a.stats.snapshot()["peer.publish_refused"] == 1  # not sent again
    finally:
        a.close()


def test_an_index_that_lost_its_data_is_filled_again_at_the_next_renewal(disk_dir, redis_server):
    a, b = _store_pair(disk_dir, redis_server.url)
    try:
        keys = make_keys(SLOTS, seed=11)
        a.put_many(keys, make_payloads(SLOTS, seed=11, chunk_bytes=CHUNK))
        a.step()
        with redis.Redis.from_url(redis_server.url) as r:
            r.flushall()  # what a restart without persistence leaves
        time.sleep(1.1)  # past B's memory of earlier answers (kvstore.cluster.node.RECENT_S)
        assert b.lookup(keys).count == 0
        faults.renewal_due(a)
        assert faults.publisher(a).step()  # the lease was gone: everything is published again
        time.sleep(1.1)
        assert b.lookup(keys).tiers == ("peer",) * SLOTS
    finally:
        a.close()
        b.close()
