"""The chunk index on a real Redis Cluster (3 masters, a replica each): hosts share
chunks through it, a master killed with SIGKILL or hung with SIGSTOP costs only the
lookups of its keys (misses within the deadline, never wrong bytes) until its replica
takes over, a shard down for good costs no host its lease, lost entries come back, and
a dead host's entries expire; eight store processes on one loop array share through it."""

from __future__ import annotations

import binascii
import contextlib
import socket
import time

import numpy as np
import pytest
from support import faults
from support.cluster import CHUNK, capacity_for, client, found, get, host_config, put, wait_for
from support.services import counters, service_config, stop_service
from support.stores import attached, make_keys, make_payloads, read_back, reads_back

import kvstore.cluster.node
from bench.support.loopdev import LoopDevices
from kvstore.cluster.connection import IndexConnection
from kvstore.cluster.index import IndexKeys
from kvstore.config.store import load_config
from kvstore.format.errors import ConfigError
from kvstore.format.secrets import masked_url
from kvstore.service.client import StoreClient
from kvstore.store.tiered import TieredStore

redis = pytest.importorskip("redis", reason="the redis client is not installed (pip install -e .)")
from redis.crc import key_slot  # noqa: E402 - the redis client's own slot function

CHUNKS = 12  # per host
# A shard of this loaded 2-core machine may answer past 0.2 s, and with engine servers in
# the other test worker the slot map's first read has taken past 0.5 s: a miss (then lookups
# are local for the backoff), yet not the test's.
DEADLINE_S = 1.0


@pytest.mark.parametrize(("url", "error"), [
    ("redis+cluster://127.0.0.1:7000/2", "names nodes only"),
    ("redis+cluster://127.0.0.1:7000,127.0.0.1", "'127.0.0.1' is not HOST:PORT"),
    ("redis+cluster://", "'' is not HOST:PORT"),
    ("cluster://127.0.0.1:7000", "must be a Redis URL"),
])
def test_a_bad_cluster_url_is_refused_naming_the_problem(url, error):
    config = {"tiers": {"dram": {"capacity": "1MiB"}}, "cluster": {"host_id": "a", "index_url": url}}
    with pytest.raises(ConfigError, match=rf"cluster\.index_url.*{error}"):
        load_config(config)


@pytest.mark.parametrize(("url", "seen"), [
    ("redis+cluster://user:s3cret@10.0.0.9:7000,10.0.0.9:7001", "redis+cluster://user:***@10.0.0.9:7000,10.0.0.9:7001"),
    ("redis://:s3cret@10.0.0.9:6379/0", "redis://:***@10.0.0.9:6379/0"),
    ("redis://10.0.0.9:6379/0", "redis://10.0.0.9:6379/0"),
    ("redis://:p@ss@10.0.0.9:6379/0", "redis://:***@10.0.0.9:6379/0"),  # a raw @ in the password
])
def test_logs_and_info_hide_the_password(url, seen):
    assert masked_url(url) == seen


def test_a_prefix_with_a_hash_tag_is_refused_for_a_cluster_only():
    config = {"tiers": {"dram": {"capacity": "1MiB"}},
              "cluster": {"host_id": "a", "index_url": "redis+cluster://h:1", "key_prefix": "kv{x}:"}}
    with pytest.raises(ConfigError, match=r"cluster\.key_prefix.*one hash slot"):
        load_config(config)
    config["cluster"]["index_url"] = "redis://h:1/0"  # one instance: as it always was
    assert load_config(config).cluster.key_prefix == "kv{x}:"


def test_a_chunk_key_hashes_whole_even_with_braces_inside():
    """Raw chunk keys are any 16 bytes; a `{x}` in one must not become its hash tag."""
    raw = b"{x}" + bytes(range(13))
    name = IndexKeys("kvstore:", cluster=True).chunk(raw)
    assert key_slot(name) == binascii.crc_hqx(name, 0) % 16384 != key_slot(b"{x}")  # CRC16 of it all
    assert IndexKeys("kvstore:", cluster=False).chunk(raw) == b"kvstore:c:" + raw  # one instance: unchanged
    assert IndexKeys("kvstore:", cluster=False).lease("a") == b"kvstore:l:a"


def test_nodes_that_accept_and_never_answer_hold_no_lookup(disk_dir):
    """The cluster client's first slot map is read in the background: a caller waits at
    most its deadline, however many startup nodes hang."""
    deadline_s = 0.2  # host_config's index_deadline_s
    listeners = [socket.create_server(("127.0.0.1", 0), backlog=16) for _ in range(5)]  # read in turn: 1 s
    try:
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{s.getsockname()[1]}" for s in listeners)
        a = TieredStore(host_config("a", ["b"], disk_dir, url), CHUNK, background=False)
        try:
            keys = make_keys(2, seed=25)
            for _ in range(3):
                started = time.monotonic()
                assert a.lookup(keys).count == 0
                assert time.monotonic() - started < 3 * deadline_s
            index = IndexConnection(url, deadline_s)
            try:
                started = time.monotonic()
                with pytest.raises(redis.TimeoutError, match="slot map"):
                    index.run([("hmget", (b"k", ["a"]))])
                assert time.monotonic() - started < 3 * deadline_s
            finally:
                index.close()
        finally:
            a.close()
    finally:
        for listener in listeners:
            listener.close()


def test_a_host_starts_with_the_cluster_unreachable_and_looks_up_locally_in_time(disk_dir):
    url = "redis+cluster://127.0.0.1:1,127.0.0.1:2"  # nothing listens there
    a = TieredStore(host_config("a", ["b"], disk_dir, url), CHUNK, background=False)  # b: never started
    try:
        keys, payloads = make_keys(2, seed=23), make_payloads(2, seed=23, chunk_bytes=CHUNK)
        assert a.put_many(keys, payloads) == [True, True]
        assert not a.step()  # it cannot publish, and says so
        started = time.monotonic()
        assert a.lookup(keys + make_keys(2, seed=24)).count == 2
        assert time.monotonic() - started < DEADLINE_S + 0.3
        assert a.stats.snapshot()["peer.index_errors"] == 1
    finally:
        a.close()


def until_at_peers(store: TieredStore, keys: list[bytes], expected: set[bytes]) -> int:
    """Wait until `store` finds `expected` of `keys` at its peers (a first read of the slot
    map past the deadline puts its index in backoff for a while: the state a test starts
    from, not what it tests); the index errors it counted by then."""
    wait_for(lambda: store.probe.at_peers(keys) == expected, 30, "the chunks at the peers")
    return store.stats.snapshot().get("peer.index_errors", 0)


def cluster_hosts(root: str, url: str, names: list[str], **cluster) -> list[TieredStore]:
    stores = []
    try:
        for name in names:
            config = host_config(name, [n for n in names if n != name], root, url)
            config["tiers"]["disk"][0]["capacity"] = capacity_for(CHUNKS)
            for peer in config["cluster"]["peers"]:
                peer["disk"][0]["capacity"] = capacity_for(CHUNKS)
            config["cluster"].update({"index_deadline_s": DEADLINE_S, **cluster})
            stores.append(TieredStore(config, CHUNK, background=True))
        for store in stores:
            faults.look_for_peer_devices(store)  # the later hosts' devices exist now
    except BaseException:
        for store in stores:
            store.close()
        raise
    return stores


def test_hosts_share_chunks_through_a_redis_cluster_whose_keys_spread_over_the_shards(
        disk_dir, redis_cluster):
    a, b = cluster_hosts(disk_dir, redis_cluster.url, ["a", "b"])
    try:
        keys, payloads = make_keys(CHUNKS, seed=20), make_payloads(CHUNKS, seed=20, chunk_bytes=CHUNK)
        assert a.put_many(keys, payloads) == [True] * CHUNKS
        assert a.step()
        until_at_peers(b, keys, set(keys))
        assert b.lookup(keys).tiers == ("peer",) * CHUNKS
        assert reads_back(b, keys, payloads)
        names = IndexKeys("kvstore:", cluster=True)
        assert len({redis_cluster.primary_of(names.chunk(key)) for key in keys}) == 3  # spread
        assert len({redis_cluster.primary_of(names.lease(h)) for h in "ab"}) == 1  # the leases: one shard
    finally:
        a.close()
        b.close()


def test_a_slot_moved_between_masters_is_followed_by_asking_and_on_moved(disk_dir, redis_cluster):
    a, b = cluster_hosts(disk_dir, redis_cluster.url, ["a", "b"])
    try:
        keys, payloads = make_keys(CHUNKS, seed=21), make_payloads(CHUNKS, seed=21, chunk_bytes=CHUNK)
        assert a.put_many(keys, payloads) == [True] * CHUNKS
        assert a.step()
        errors = until_at_peers(b, keys, set(keys))
        moved = IndexKeys("kvstore:", cluster=True).chunk(keys[0])
        source = redis_cluster.primary_of(moved)
        target = next(port for port in redis_cluster.primaries(source) if port != source)

        def midway() -> None:  # the key is on the target, the slot still the source's: ASK
            assert b.probe.at_peers(keys) == set(keys)

        redis_cluster.move_slot(moved, target, midway)
        assert redis_cluster.primary_of(moved) == target
        assert b.probe.at_peers(keys) == set(keys)  # MOVED, then the new map
        assert reads_back(b, keys, payloads)
        more, more_payloads = make_keys(4, seed=22), make_payloads(4, seed=22, chunk_bytes=CHUNK)
        assert a.put_many(more, more_payloads) == [True] * 4  # evicting 4 of the first
        assert a.step()  # writes follow the new map too
        assert reads_back(b, more, more_payloads)
        assert b.stats.snapshot().get("peer.index_errors", 0) == errors
    finally:
        a.close()
        b.close()


class Trace:
    """Every host reads every other host's chunks, again and again, and tells hits,
    misses and wrong bytes apart, timing each lookup."""

    def __init__(self, stores: list[TieredStore], keys: list[list[bytes]],
                 payloads: list[list[np.ndarray]]) -> None:
        self.stores, self.keys, self.payloads = stores, keys, payloads
        self.wrong = 0
        self.slowest = 0.0

    def round(self, hosts: range | list[int], owners: list[int] | None = None) -> tuple[int, int]:
        """One pass: (hits, misses) of each host in `hosts` reading the `owners`' chunks."""
        hits = misses = 0
        for me in hosts:
            for owner in owners if owners is not None else range(len(self.stores)):
                if owner == me:
                    continue
                started = time.monotonic()
                self.stores[me].lookup(self.keys[owner])
                self.slowest = max(self.slowest, time.monotonic() - started)
                ok, outs = read_back(self.stores[me], self.keys[owner])
                for served, out, payload in zip(ok, outs, self.payloads[owner], strict=True):
                    hits += served
                    misses += not served
                    self.wrong += served and not (out == payload).all()
        return hits, misses


def test_a_killed_master_costs_only_its_keys_until_its_replica_takes_over(
        disk_dir, redis_cluster, monkeypatch):
    monkeypatch.setattr(kvstore.cluster.node, "RECENT_S", 0.0)  # every lookup asks the index
    monkeypatch.setattr(kvstore.cluster.node, "RECENT_MISS_S", 0.0)
    names = ["a", "b", "c", "d"]
    stores = cluster_hosts(disk_dir, redis_cluster.url, names, lease_s=3.0, republish_s=2.0,
                           index_backoff_s=0.3)
    try:
        keys = [make_keys(CHUNKS, seed=30 + i) for i in range(4)]
        payloads = [make_payloads(CHUNKS, seed=30 + i, chunk_bytes=CHUNK) for i in range(4)]
        for store, own, data in zip(stores, keys, payloads, strict=True):
            assert store.put_many(own, data) == [True] * CHUNKS
        trace = Trace(stores, keys, payloads)
        everything = 4 * 3 * CHUNKS
        wait_for(lambda: trace.round(range(4))[0] == everything, what="every host finding the others'")
        index = IndexKeys("kvstore:", cluster=True)
        victim = redis_cluster.primary_of(index.lease("a"))  # the leases' shard, and a third of the keys
        on_victim = sum(redis_cluster.primary_of(index.chunk(k)) == victim for own in keys for k in own)
        assert 0 < on_victim < 4 * CHUNKS
        redis_cluster.kill(victim)
        killed = time.monotonic()

        # Until the replica is promoted: the other shards' chunks are hits (the leases as
        # last read), the dead shard's are misses, each lookup within the deadline.
        hits, misses = trace.round(range(4))
        assert misses > 0 and hits >= everything - 3 * on_victim
        redis_cluster.wait_until(lambda: victim not in redis_cluster.primaries(redis_cluster.live()), 30,
                                 "the replica's promotion")
        promoted = time.monotonic() - killed
        assert stores[0].stats.snapshot()["peer.index_shard_misses"] > 0

        # Hits come back, no host restarted (the slot map is read again by the client).
        wait_for(lambda: trace.round(range(4))[0] == everything, timeout_s=15, what="hits after failover")
        back = time.monotonic() - killed
        assert trace.slowest < DEADLINE_S + 0.3

        # Entries the index lost without an error (as a failover loses writes its replica had
        # not received) are sent again by their host within republish_s. Host a's publishing
        # thread is stopped first (its steps are then taken here), so no republish can
        # restore them before they are seen missing.
        publisher = faults.publisher(stores[0])
        stop_thread(publisher)
        with redis.RedisCluster(host="127.0.0.1", port=redis_cluster.live()) as r:
            assert [r.hdel(index.chunk(key), "a") for key in keys[0][:4]] == [1] * 4
        assert stores[1].probe.at_peers(keys[0]) == set(keys[0][4:])
        wait_for(lambda: publisher.step() and trace.round([1], [0]) == (CHUNKS, 0), timeout_s=5,
                 what="the lost entries back")
        assert stores[0].stats.snapshot()["peer.republished"] > 0

        # A host that dies (its publisher stops, its lease is not withdrawn): its entries
        # stop counting once its lease runs out, the others' stay.
        stop_thread(faults.publisher(stores[3]))
        died = time.monotonic()
        wait_for(lambda: trace.round([0], [3]) == (0, CHUNKS), timeout_s=6, what="the dead host's expiry")
        assert time.monotonic() - died < 3.0 + 1.5
        assert stores[0].stats.snapshot()["peer.index_expired"] > 0
        assert trace.round([0], [1, 2]) == (2 * CHUNKS, 0)
        assert trace.wrong == 0
        stores.pop(1).close()  # a clean stop after the failover withdraws the lease at once
        with redis.RedisCluster(host="127.0.0.1", port=redis_cluster.live()) as r:
            assert not r.exists(index.lease("b"))
        print(f"failover: promoted after {promoted:.1f} s, all hits back after {back:.1f} s, "
              f"slowest lookup {trace.slowest * 1000:.0f} ms")
    finally:
        for store in stores:
            store.close()


def stop_thread(publisher) -> None:
    """Stop a host's publishing thread as its death would (the lease is not withdrawn)."""
    publisher._stop.set()
    publisher._wake.set()
    publisher._thread.join(5)
    assert not publisher._thread.is_alive()


def test_a_hung_master_costs_only_its_keys_within_the_deadline(disk_dir, redis_cluster):
    """SIGSTOP: the master accepts and never answers. A 60-key lookup still returns
    within the deadline (redis-py's pipeline then retries the hung shard's commands one
    by one, for seconds, on a thread nobody waits for), the other shards' keys are hits,
    and only that shard is skipped afterwards."""
    a, b = cluster_hosts(disk_dir, redis_cluster.url, ["a", "b"], index_backoff_s=5.0)
    try:
        keys, payloads = make_keys(CHUNKS, seed=26), make_payloads(CHUNKS, seed=26, chunk_bytes=CHUNK)
        assert a.put_many(keys, payloads) == [True] * CHUNKS
        assert a.step()
        index = IndexKeys("kvstore:", cluster=True)
        leases = redis_cluster.primary_of(index.lease("a"))
        hung = next(port for port in redis_cluster.primaries(leases) if port != leases)
        alive = {k for k in keys if redis_cluster.primary_of(index.chunk(k)) != hung}
        assert 0 < len(alive) < CHUNKS
        asked = keys + make_keys(60 - CHUNKS, seed=27)  # 60 keys, as a long prompt's lookup
        errors = until_at_peers(b, asked, set(keys))
        redis_cluster.pause(hung)
        try:
            took = []
            for _ in range(3):  # the first pays the deadline, the next skip the hung shard at once
                started = time.monotonic()
                answer = faults.index_locate(b, asked)
                took.append(time.monotonic() - started)
                assert took[-1] < 3 * DEADLINE_S, f"a lookup took {took[-1]:.2f} s with a master hung"
                assert answer is not None and answer.keys() == alive
            stats = b.stats.snapshot()
            assert stats["peer.index_shard_misses"] >= 3 * (CHUNKS - len(alive))
            assert stats.get("peer.index_errors", 0) == errors  # the index as a whole was never given up
            print("hung master: 60-key lookups took " + ", ".join(f"{t * 1000:.0f}" for t in took) + " ms")
        finally:
            redis_cluster.resume(hung)
    finally:
        a.close()
        b.close()


def test_a_shard_down_for_good_costs_no_host_its_lease(disk_dir, redis_cluster):
    """A shard other than the leases' loses its master and its replica: no failover. Each
    host still renews its lease (it goes alone, not in a pipeline that spans the dead
    shard) and publishes to the live shards, so past `lease_s` the live shards' chunks
    are still hits."""
    lease_s = 1.5
    a, b = cluster_hosts(disk_dir, redis_cluster.url, ["a", "b"], lease_s=lease_s, republish_s=1.0)
    try:
        keys, payloads = make_keys(CHUNKS, seed=28), make_payloads(CHUNKS, seed=28, chunk_bytes=CHUNK)
        assert a.put_many(keys, payloads) == [True] * CHUNKS
        wait_for(lambda: b.lookup(keys).tiers == ("peer",) * CHUNKS, what="b finding a's chunks")
        index = IndexKeys("kvstore:", cluster=True)
        leases = redis_cluster.primary_of(index.lease("a"))
        dead = next(port for port in redis_cluster.primaries(leases) if port != leases)
        alive = [k for k in keys if redis_cluster.primary_of(index.chunk(k)) != dead]
        assert 0 < len(alive) < CHUNKS
        for port in [dead, *redis_cluster.replicas(dead)]:
            redis_cluster.kill(port)
        time.sleep(2 * lease_s)  # every lease read before the kill has run out by now
        assert b.probe.at_peers(keys) == set(alive)
        assert reads_back(b, alive, [payloads[keys.index(k)] for k in alive])
        assert a.stats.snapshot()["peer.publish_errors"] > 0  # the dead shard's writes failed
    finally:
        a.close()
        b.close()


@pytest.mark.slow
@pytest.mark.loopdev
def test_eight_store_processes_on_one_loop_array_share_through_the_cluster_index(
        tmp_path, redis_cluster):
    """Eight `kvstore serve` processes, each writing its own loop device (the array's eight
    namespaces) and reading the other seven's through the Redis Cluster index; then a
    master is killed and every host finds every chunk again, none restarted."""
    hosts = [f"h{i}" for i in range(8)]
    with attached(LoopDevices(str(tmp_path), 8, 8 << 20)) as loops:
        def config(me: int) -> dict:
            def disk(i: int) -> list[dict]:
                return [{"path": loops.devices[i], "capacity": "4MiB"}]

            return {"tiers": {"disk": disk(me)}, "io": {"engine": "uring", "timeout_s": 5},
                    **service_config(tmp_path, socket=f"{hosts[me]}.sock"),
                    "cluster": {"host_id": hosts[me], "index_url": redis_cluster.url, "lease_s": 3.0,
                                "index_deadline_s": DEADLINE_S, "index_backoff_s": 0.3,
                                "peers": [{"host_id": hosts[i], "disk": disk(i)}
                                          for i in range(8) if i != me]}}

        configs = [config(i) for i in range(8)]
        with contextlib.ExitStack() as closing:
            for c in configs:
                closing.callback(stop_service, c)
            stores = [client(c) for c in configs]
            for store in stores:
                closing.callback(store.close)
            keys = [make_keys(4, seed=40 + i) for i in range(8)]
            payloads = [make_payloads(4, seed=40 + i, chunk_bytes=CHUNK) for i in range(8)]
            for store, own, data in zip(stores, keys, payloads, strict=True):
                assert put(store, own, data) == [True] * 4
            others = {me: [k for i in range(8) if i != me for k in keys[i]] for me in range(8)}
            expected = {me: [p.tobytes() for i in range(8) if i != me for p in payloads[i]]
                        for me in range(8)}

            def everyone_reads_everything() -> bool:
                for me, store in enumerate(stores):
                    if found(store, others[me]) != 28:
                        return False
                    ok, data = get_all(store, others[me])
                    assert all(d == e for served, d, e in zip(ok, data, expected[me], strict=True) if served)
                    if not all(ok):
                        return False
                return True

            wait_for(everyone_reads_everything, timeout_s=30, what="every host reading the other seven")
            assert all(counters(c)["peer.hits"] >= 28 for c in configs)
            index = IndexKeys("kvstore:", cluster=True)
            redis_cluster.kill(redis_cluster.primary_of(index.chunk(keys[0][0])))
            time.sleep(1.1)  # past the hosts' memory of earlier answers (kvstore.cluster.node.RECENT_S)
            wait_for(everyone_reads_everything, timeout_s=30, what="every host reading all after failover")
            assert sum(counters(c).get("peer.index_shard_misses", 0) for c in configs) > 0


def get_all(store: StoreClient, keys: list[bytes]) -> tuple[list[bool], list[bytes]]:
    """`get` in waves of the 1 MiB staging window (15 chunks of 64 KiB)."""
    ok, data = [], []
    for start in range(0, len(keys), 15):
        wave = keys[start : start + 15]
        served, got = get(store, wave)
        ok += served
        data += got
    return ok, data
