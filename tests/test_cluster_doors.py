"""The cluster's doors, against real redis-servers that require them: an index behind an
ACL user or a password, and behind TLS with client certificates (a throwaway CA made
with openssl for the test), shared by two hosts with exactly the Redis permissions
docs/cluster.md lists; a second host with one host_id refused at start, naming the first;
passwords masked wherever a URL is printed or logged; and index entries and leases of
any shape, written by anyone who can write the index, read as counted misses."""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import faults
from support.cluster import CHUNK, host_config
from support.stalls import stall_meter
from support.stores import make_keys, make_payloads, read_back

from bench.support.redis_server import RedisServer, redis_server_unavailable
from kvstore.cluster.connection import IndexConnection
from kvstore.cluster.index import IndexKeys, IndexReader, LeaseHolder, Location
from kvstore.cluster.lease import HostIdInUse
from kvstore.config.store import load_config
from kvstore.format.errors import ConfigError
from kvstore.format.secrets import masked, masked_url
from kvstore.store.tiered import TieredStore
from kvstore.tiers.stats import Stats

redis = pytest.importorskip("redis", reason="the redis client is not installed (pip install -e .)")

PASSWORD = "s3cret-Pa55"
# What kvstore's hosts need of the index (docs/cluster.md gives this line): its own keys,
# the commands the publisher and the lookups send, nothing else.
ACL = ["kvstore", "on", f">{PASSWORD}", "~kvstore:*", "+ping", "+hset", "+hdel", "+hmget", "+sadd", "+srem",
       "+sscan", "+set", "+get", "+del", "+mget"]
ADMIN = ["admin", "on", ">admin-pw", "~*", "+@all"]  # the test's own writes and checks


@pytest.fixture
def started(tmp_path) -> Iterator:
    """Start redis-servers with options (stopped after the test)."""
    reason = redis_server_unavailable()
    if reason:
        pytest.skip(reason)
    servers: list[RedisServer] = []

    def start(args: list[str], tls: bool = False) -> RedisServer:
        workdir = tmp_path / f"redis{len(servers)}"
        workdir.mkdir()
        server = RedisServer(workdir, args, tls)
        servers.append(server)
        try:
            server.start()
        except RuntimeError:
            log = "".join(p.read_text(errors="replace") for p in workdir.glob("*.log"))
            if tls and "TLS" in log:
                pytest.skip(f"this redis-server was built without TLS: {log[-300:]}")
            raise
        return server

    yield start
    for server in servers:
        server.stop()


def users(*acls: list[str]) -> list[str]:
    """redis-server options: the default (unauthenticated) user off, these users on."""
    return ["--user", "default", "off", *(arg for acl in acls for arg in ["--user", *acl])]


def with_user(url: str, user: str, password: str) -> str:
    return url.replace("://", f"://{user}:{password}@", 1)


def share(root: Path, url: str, **cluster) -> tuple[list[bool], list[str]]:
    """Host a stores chunks, host b finds them through the index and reads them from a's
    device: (b's reads, the tiers b's lookup gave)."""
    root.mkdir(exist_ok=True)
    configs = [host_config(name, [other], str(root), url) for name, other in (("a", "b"), ("b", "a"))]
    for config in configs:
        config["cluster"].update(cluster)
    a = TieredStore(configs[0], CHUNK, background=False)
    try:
        b = TieredStore(configs[1], CHUNK, background=False)
        try:
            b.step()  # a's device found
            keys, payloads = make_keys(2, seed=51), make_payloads(2, seed=51, chunk_bytes=CHUNK)
            assert a.put_many(keys, payloads) == [True, True]
            a.step()
            tiers = list(b.lookup(keys).tiers)
            ok, outs = read_back(b, keys)
            return [o and bool((out == p).all()) for o, out, p in zip(ok, outs, payloads, strict=True)], tiers
        finally:
            b.close()
    finally:
        a.close()


def refused_without_credentials(url: str, **options) -> None:
    """The index really is closed: a client without the user's password is refused."""
    with pytest.raises(redis.AuthenticationError), redis.Redis.from_url(url, **options) as r:
        r.ping()


@pytest.mark.parametrize("door", ["acl-user", "requirepass"])
def test_hosts_share_through_an_index_that_requires_a_password(started, disk_dir, door, caplog):
    if door == "acl-user":
        server = started(users(ACL))
        url = with_user(server.url, "kvstore", PASSWORD)
    else:
        server = started(["--requirepass", PASSWORD])
        url = server.url.replace("://", f"://:{PASSWORD}@", 1)
    refused_without_credentials(server.url)
    assert share(Path(disk_dir), url) == ([True, True], ["peer", "peer"])

    caplog.set_level(logging.DEBUG)  # a wrong password: lookups are local only, and no log says it
    wrong = url.replace(PASSWORD, "not-the-password")
    assert share(Path(disk_dir) / "wrong", wrong)[1] == []
    assert "not-the-password" not in caplog.text and "invalid username-password" in caplog.text.lower()


def make_certificates(where: Path) -> dict[str, Path]:
    """A throwaway CA, a certificate for 127.0.0.1 and a client's, signed by it; and a
    second CA that signed neither."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed: the TLS test makes its certificates with it")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=where, check=True, capture_output=True, timeout=60)

    for ca in ("ca", "other-ca"):
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN=kvstore test {ca}",
            "-keyout", f"{ca}.key", "-out", f"{ca}.crt")
    (where / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
            "-out", f"{name}.csr")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "1", "-out", f"{name}.crt", "-extfile", "san.ext")
    for key in where.glob("*.key"):
        key.chmod(0o600)
    return {name: where / name for name in ("ca.crt", "other-ca.crt", "server.crt", "server.key",
                                            "client.crt", "client.key")}


def test_hosts_share_through_an_index_behind_tls_with_client_certificates(started, disk_dir, tmp_path):
    files = make_certificates(tmp_path)
    server = started(["--tls-cert-file", str(files["server.crt"]), "--tls-key-file", str(files["server.key"]),
                      "--tls-ca-cert-file", str(files["ca.crt"]), "--tls-auth-clients", "yes",
                      *users(ACL)], tls=True)
    url = with_user(server.url, "kvstore", PASSWORD)
    tls = {"ca_file": str(files["ca.crt"]), "cert_file": str(files["client.crt"]),
           "key_file": str(files["client.key"])}
    assert share(Path(disk_dir), url, index_tls=tls) == ([True, True], ["peer", "peer"])

    no_client_certificate = {"ca_file": tls["ca_file"]}
    another_ca = {**tls, "ca_file": str(files["other-ca.crt"])}
    for name, wrong in (("no-cert", no_client_certificate), ("other-ca", another_ca)):
        assert share(Path(disk_dir) / name, url, index_tls=wrong)[1] == [], name  # local only
    with pytest.raises(redis.ConnectionError), redis.Redis(port=server.port, socket_timeout=2) as r:
        r.ping()  # plain text to a TLS port


def test_tls_files_are_refused_for_a_plain_url():
    config = {"tiers": {"dram": {"capacity": "1MiB"}},
              "cluster": {"host_id": "a", "index_url": "redis://h:1/0", "index_tls": {"ca_file": "ca.crt"}}}
    with pytest.raises(ConfigError, match=r"cluster\.index_tls.*rediss://"):
        load_config(config)
    config["cluster"].update(index_url="rediss://h:1/0", index_tls={"cert_file": "c.crt"})
    with pytest.raises(ConfigError, match=r"cluster\.index_tls\.key_file.*together"):
        load_config(config)


def admin(server: RedisServer) -> redis.Redis:
    return redis.Redis(port=server.port, username="admin", password="admin-pw", socket_timeout=5)


def test_a_second_host_with_one_host_id_is_refused_at_start_naming_the_first(started, disk_dir):
    server = started(users(ACL, ADMIN))
    url = with_user(server.url, "kvstore", PASSWORD)
    first = TieredStore(host_config("a", ["b"], disk_dir, url), CHUNK, background=False)
    try:
        twin = host_config("a", ["b"], os.path.join(disk_dir, "twin"), url)
        os.makedirs(os.path.join(disk_dir, "twin"))
        with pytest.raises(HostIdInUse, match=rf"cluster\.host_id.*in use by {socket.gethostname()} "
                                               rf"\(pid {os.getpid()}\)"):
            TieredStore(twin, CHUNK, background=False)
        assert first.step()  # the first goes on, its lease its own
    finally:
        first.close()
    with admin(server) as r:  # a clean stop withdrew the lease
        assert r.get(IndexKeys("kvstore:", cluster=False).lease("a")) is None
    TieredStore(twin, CHUNK, background=False).close()  # so the id is free again


@pytest.mark.parametrize(("holder", "refused"), [
    (LeaseHolder(7, "gpu-host-2", "boot", 4242), "gpu-host-2 (pid 4242)"),  # another machine
    (LeaseHolder(7, socket.gethostname(), "another boot", 1), f"{socket.gethostname()} (pid 1)"),
    (None, "a lease of another format"),
])
def test_a_live_lease_of_another_host_refuses_the_start(started, disk_dir, holder, refused):
    server = started(users(ACL, ADMIN))
    with admin(server) as r:
        r.set(IndexKeys("kvstore:", cluster=False).lease("a"), holder.pack() if holder else b"junk", px=60000)
    with pytest.raises(HostIdInUse, match=re.escape(f"in use by {refused}")):
        TieredStore(host_config("a", ["b"], disk_dir, with_user(server.url, "kvstore", PASSWORD)), CHUNK,
                    background=False)


def test_this_machines_ended_service_leaves_a_lease_that_a_restart_takes_over(started, disk_dir):
    server = started(users(ACL, ADMIN))
    gone = subprocess.Popen(["true"])  # a pid that has exited
    gone.wait()
    lease = IndexKeys("kvstore:", cluster=False).lease("a")
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    with admin(server) as r:
        r.set(lease, LeaseHolder(7, socket.gethostname(), boot, gone.pid).pack(), px=60000)
    store = TieredStore(host_config("a", ["b"], disk_dir, with_user(server.url, "kvstore", PASSWORD)), CHUNK,
                        background=False)
    try:
        with admin(server) as r:
            assert LeaseHolder.unpack(r.get(lease)) == faults.publisher(store).lease.mine
    finally:
        store.close()


def test_a_store_reopened_after_a_crash_in_the_same_process_takes_its_lease_back(started, disk_dir):
    server = started(users(ACL, ADMIN))
    config = host_config("a", ["b"], disk_dir, with_user(server.url, "kvstore", PASSWORD))
    TieredStore(config, CHUNK, background=False).simulate_crash()  # its lease lives on
    with admin(server) as r:
        assert r.get(IndexKeys("kvstore:", cluster=False).lease("a")) is not None
    TieredStore(config, CHUNK, background=False).close()


def test_a_host_whose_id_another_host_took_while_it_was_away_stops_publishing(started, disk_dir, caplog):
    server = started(users(ACL, ADMIN))
    store = TieredStore(host_config("a", ["b"], disk_dir, with_user(server.url, "kvstore", PASSWORD)), CHUNK,
                        background=False)
    lease = IndexKeys("kvstore:", cluster=False).lease("a")
    other = LeaseHolder(9, "gpu-host-3", "boot", 77).pack()
    try:
        with admin(server) as r:
            r.set(lease, other, px=60000)
        assert not store.step()
        assert "in use by gpu-host-3 (pid 77)" in caplog.text
        assert store.stats.snapshot()["peer.host_id_conflicts"] == 1
        assert "gpu-host-3" in store.info()["cluster"]["host_id_conflict"]
        with admin(server) as r:
            assert r.get(lease) == other  # its lease back, this host's gone
    finally:
        store.close()
    with admin(server) as r:
        assert r.get(lease) == other  # not withdrawn: it was never this host's


def test_passwords_are_masked_in_errors_logs_and_info(redis_server, disk_dir, caplog):
    with pytest.raises(ConfigError) as refused:  # a bad URL is quoted in the error
        load_config({"tiers": {"dram": {"capacity": "1MiB"}},
                     "cluster": {"host_id": "a", "index_url": f"redis+cluster://u:{PASSWORD}@nohost"}})
    assert PASSWORD not in str(refused.value) and "u:***@nohost" in str(refused.value)

    caplog.set_level(logging.DEBUG)
    url = f"redis://kvstore:{PASSWORD}@127.0.0.1:{redis_server.port}/0"  # no such user: refused
    config = host_config("a", ["b"], disk_dir, url)
    config["io"]["timeout_s"] = 10.0  # logs are tested here, not deadlines: none met late on a busy host
    store = TieredStore(config, CHUNK, background=False)
    try:
        store.lookup(make_keys(1, seed=3))
        store.step()
        info = store.info()["cluster"]
    finally:
        store.close()
    assert info["index_url"] == f"redis://kvstore:***@127.0.0.1:{redis_server.port}/0"
    assert PASSWORD not in caplog.text and "kvstore:***@" in caplog.text


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zs", "Zl", "Zp"), blacklist_characters="\"'"),
               max_size=30), st.sampled_from(["redis", "rediss", "redis+cluster", "unix"]))
def test_a_password_never_survives_the_mask(text, scheme):
    password = f"Q{text}Q"  # marked, so that it cannot be the user or host shown beside it
    for url in (f"{scheme}://user:{password}@10.0.0.9:6379/0", f"{scheme}://:{password}@h:1",
                f"{scheme}://h:1/0?db=0&password={password}"):
        for shown in (masked_url(url), masked(f"config field 'x' = {url!r}: bad")):
            assert password not in shown, (url, shown)
    assert masked_url("redis://10.0.0.9:6379/0?db=1") == "redis://10.0.0.9:6379/0?db=1"


# -- index entries as anyone who can write the index may leave them -----------------------


ENTRY = Location(generation=5, device=0, device_id=b"\0" * 8, slot=1, seq=3).pack()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entry=st.one_of(st.binary(max_size=64), st.just(ENTRY)),
       lease=st.one_of(st.none(), st.binary(max_size=40), st.just(LeaseHolder(5, "b", "", 1).pack())),
       wrong_type=st.booleans())
def test_any_index_entry_or_lease_is_a_counted_miss_never_an_exception(redis_server, entry, lease,
                                                                       wrong_type):
    peer = {"host_id": "b", "disk": {"path": "/nowhere", "capacity": "1MiB"}}
    config = load_config({"tiers": {"dram": {"capacity": "1MiB"}},
                          "cluster": {"host_id": "a", "index_url": redis_server.url, "index_deadline_s": 2,
                                      "peers": [peer]}})
    assert config.cluster is not None
    stats = Stats()
    reader = IndexReader(config.cluster, stats)
    names = IndexKeys("kvstore:", cluster=False)
    key, good = b"k" * 16, b"g" * 16
    try:
        with redis.Redis.from_url(redis_server.url) as r:
            r.flushall()
            if wrong_type:
                r.set(names.chunk(key), entry)  # a string where a hash belongs
            else:
                r.hset(names.chunk(key), "b", entry)
            r.hset(names.chunk(good), "b", ENTRY)
            if lease is not None:
                r.set(names.lease("b"), lease)
        found = reader.locate([key, good])
    finally:
        reader.close()
    assert found is not None  # the index answered: one bad entry never fails the lookup
    counters = stats.snapshot()
    holder = None if lease is None else LeaseHolder.unpack(lease)
    assert (good in found) == (holder is not None and holder.generation == 5)
    location = None if wrong_type else Location.unpack(entry)
    valid = location is not None
    # An entry counts while its host's lease lives and names the entry's generation.
    assert (key in found) == (location is not None and holder is not None
                              and location.generation == holder.generation)
    if wrong_type or not valid:
        assert counters["peer.index_malformed"] >= 1
    assert counters.get("peer.index_errors", 0) == 0


def test_a_host_name_slow_to_resolve_holds_no_index_request_past_its_deadline(redis_server, tmp_path,
                                                                               monkeypatch):
    """A single instance reconnects on the caller's request and resolves its host's name
    first, which no socket timeout bounds (a DNS server that does not answer holds it for
    the resolver's own timeout, 5 s by default). The request is sent from a worker thread
    now, as a cluster shard's is: the caller has its answer, a failure, at the deadline."""
    index = IndexConnection(redis_server.url.replace("127.0.0.1", "localhost"), timeout_s=0.2)
    resolve = socket.getaddrinfo

    def slow(host, *args, **kwargs):
        if host == "localhost":
            time.sleep(3.0)
        return resolve(host, *args, **kwargs)

    try:
        assert index.run([("set", (b"kvstore-test-key", b"1"))]) == [True]
        index.client.connection_pool.disconnect()  # the next request reconnects
        monkeypatch.setattr(socket, "getaddrinfo", slow)
        def failed() -> None:
            with pytest.raises(redis.TimeoutError):
                index.run([("get", (b"kvstore-test-key",))])

        with stall_meter(tmp_path) as meter:
            _, seconds, stalled = meter.timed(failed)
        assert seconds - stalled < 1.5, seconds
        monkeypatch.undo()
        deadline = time.monotonic() + 10
        while True:  # once the stuck reconnect ends, requests are answered again
            try:
                assert index.run([("get", (b"kvstore-test-key",))]) == [b"1"]
                break
            except redis.TimeoutError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        index.close()
