"""The per-host service: started on demand, shared by clients, never a hang."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import typing

import pytest
from support.services import service_client, service_config, stop_service

from bench.support.processes import paused
from kvstore.config.store import load_config
from kvstore.format.checksum import PIECE
from kvstore.format.errors import KVStoreError
from kvstore.io.streaming import loader_thresholds, streaming_tunable
from kvstore.service import protocol as P
from kvstore.service.client import ServiceUnavailable, StoreClient
from kvstore.service.client import stop_service as stop_service_now

CHUNK = 64 * 1024


@pytest.fixture
def config(tmp_path, disk_dir):
    raw = service_config(tmp_path, dram="4MiB", disk_dir=disk_dir, disk="16MiB", io={"timeout_s": 0.5})
    yield raw
    stop_service(raw)


def test_a_lookup_before_any_worker_said_its_chunk_size_is_a_miss(config):
    scheduler = StoreClient(load_config(config))  # the store is created on a worker's hello
    assert scheduler.residency([b"k" * 16], prefetch=True) == (0, 0, False)
    scheduler.close()


def test_clients_share_one_spawned_service(config):
    writer = StoreClient(load_config(config), CHUNK)
    reader = StoreClient(load_config(config), CHUNK)
    scheduler = StoreClient(load_config(config))
    keys = [bytes([i]) * 16 for i in range(4)]
    for i in range(4):
        writer.memory.slot(i)[:] = bytes([i + 1]) * CHUNK
    assert writer.put(keys, [0, 1, 2, 3]) == [True] * 4
    assert scheduler.residency(keys) == (4, 4, False)
    assert scheduler.residency([b"\xff" * 16, *keys]) == (0, 0, False)
    assert reader.get(keys[::-1], [5, 6, 7, 8]) == [True] * 4
    assert bytes(reader.memory.slot(5)[:2]) == b"\4\4" and bytes(reader.memory.slot(8)[:2]) == b"\1\1"
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"kvstore-window-{os.getpid()}-")]
    for client in (writer, reader, scheduler):
        client.close()


def test_every_kind_of_request_reaches_the_part_that_answers_it(config):
    """Each kind the protocol decodes is in the service's table of answers: none comes back
    as an unknown request (a kind added to the protocol and not to the table would). Before
    a hello the data requests are clear errors, the others answers; Shutdown is the server's."""
    kinds = set(typing.get_args(P.Request)) - {P.Hello, P.Shutdown}
    requests = [P.Residency([]), P.Finished([]), P.Expect([], 0.0), P.Count({}), P.Get([], []), P.Put([], []),
                P.Pin([]), P.Unpin([]), P.Info(), P.Events(-1), P.Announce([]), P.Namespaces(), P.Purge([])]
    assert {type(request) for request in requests} == kinds
    StoreClient(load_config(config)).close()  # spawns the service
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(config["service"]["socket"])
    channel = P.Channel(sock)
    try:
        answered = {}
        for request in requests:
            channel.send(request)
            reply = channel.recv(P.REPLY, 10)
            answered[type(request).__name__] = reply.error or "ok"
    finally:
        channel.close()
    assert not [kind for kind, error in answered.items() if "unknown request" in error], answered
    needs_window = {kind for kind, error in answered.items() if "needs a hello with a chunk size" in error}
    assert needs_window == {"Get", "Put", "Pin"}, answered
    assert [error for kind, error in answered.items() if kind not in needs_window] == ["ok"] * 10, answered


def test_a_service_with_another_config_is_refused(config):
    StoreClient(load_config(config), CHUNK).close()
    other = {**config, "write_behind_chunks": 3}
    with pytest.raises(KVStoreError, match="another config"):
        StoreClient(load_config(other), CHUNK)
    with pytest.raises(KVStoreError, match=f"chunks of {CHUNK} bytes"):
        StoreClient(load_config(config), 2 * CHUNK)


def test_a_spawned_service_streams_its_copies_into_dram_slots(config, monkeypatch):
    """Started with the GLIBC_TUNABLES under which its puts' copies (PIECE at a time)
    stream past the cache (kvstore/io/streaming.py), though the engine that spawns it set
    its own threshold for its own copies (as the vLLM worker's advice says), and beside the
    engine's other entries."""
    wanted = streaming_tunable(PIECE, loader_thresholds(""))
    if wanted is None:
        pytest.skip("this glibc streams a put's copies already, or is not glibc")
    engine = "glibc.malloc.arena_max=2:glibc.cpu.x86_non_temporal_threshold=0x80000"
    monkeypatch.setenv("GLIBC_TUNABLES", engine)
    StoreClient(load_config(config)).close()  # spawns the service from this "engine"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(config["service"]["socket"])
        pid, _, _ = P.peer_credentials(sock)
    with open(f"/proc/{pid}/environ", "rb") as f:
        environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    # glibc cuts its copy at each ':' as it reads it, so /proc shows the first entry only
    # (the others' order is kvstore/io/streaming.py's, tested in tests/test_streaming.py).
    assert environ[b"GLIBC_TUNABLES"].decode() == wanted.split(":")[0]


def test_no_service_and_no_spawn_is_a_clear_error(config):
    with pytest.raises(ServiceUnavailable, match="no kvstore service at"):
        service_client(config)


def test_an_unusable_disk_path_fails_at_spawn_naming_the_field(config):
    config["tiers"]["disk"][0]["path"] = "/etc/hostname/kvstore"
    with pytest.raises(KVStoreError, match=r"'tiers.disk\[0\].path'"):
        StoreClient(load_config(config), CHUNK)


def test_a_hung_service_costs_a_deadline_not_a_hang(config):
    client = StoreClient(load_config(config), CHUNK)
    pid = client.info()["service_pid"]
    try:
        with paused(pid):
            with pytest.raises(ServiceUnavailable, match="no answer"):
                client.get([b"k" * 16], [0])
            with pytest.raises(ServiceUnavailable):  # the connection is dropped, not reused
                client.residency([b"k" * 16])
    finally:
        client.close()


def _fill_backlog(path: str) -> list[socket.socket]:
    """Connections queued at a listener that accepts none, until its backlog is full."""
    queued = []
    while True:
        peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        peer.setblocking(False)
        queued.append(peer)
        try:
            peer.connect(path)
        except BlockingIOError:
            return queued


def test_a_service_whose_backlog_is_full_is_unavailable_not_an_os_error(tmp_path):
    """A hung service accepts no connection: once its listener's backlog is full a
    connect() fails at once with EAGAIN, which must reach the engine as a miss."""
    raw = service_config(tmp_path, dram="4MiB", socket="run/kvstore.sock", spawn=False)
    path = raw["service"]["socket"]
    os.makedirs(os.path.dirname(path), mode=0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(0)
    queued = _fill_backlog(path)  # nothing is ever accepted
    try:
        with pytest.raises(ServiceUnavailable, match="accepts no connection"):
            StoreClient(load_config(raw), CHUNK)
    finally:
        for peer in queued:
            peer.close()
        listener.close()


def test_the_owner_stops_a_hung_service_whose_backlog_is_full(config):
    """A hung service (SIGSTOP) whose listen backlog engines have filled answers no
    connection at all: `kvstore stop` finds it by the lock it holds, sends SIGTERM and,
    as a stopped process cannot act on it, says so with its pid within the wait it was
    given; resumed, the service ends as on a stop. (Before, the stop said no service ran.)"""
    client = StoreClient(load_config(config), CHUNK)
    pid = client.info()["service_pid"]
    client.close()
    queued: list[socket.socket] = []
    try:
        with paused(pid):
            queued = _fill_backlog(config["service"]["socket"])
            with pytest.raises(ServiceUnavailable, match=f"pid {pid}.*kill -KILL {pid}"):
                stop_service_now(load_config(config), timeout_s=1.0)
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{pid}") and not os.path.exists(config["service"]["socket"])
    finally:
        for peer in queued:
            peer.close()


def test_a_socket_or_lock_planted_at_the_path_is_never_signalled(config, tmp_path):
    """Another process of the owner's listening at a service's socket path (a link planted
    there, to an agent's socket say), and a link to a running service's lock beside it:
    the stop is refused as the hello was, and neither process is signalled."""
    service = StoreClient(load_config(config), CHUNK)
    other = subprocess.Popen([sys.executable, "-c", PLAIN_LISTENER, str(tmp_path / "agent.sock")],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline() == "listening\n"
        planted = service_config(tmp_path / "planted", dram="4MiB", socket="run/kvstore.sock", spawn=False)
        path = planted["service"]["socket"]
        os.makedirs(os.path.dirname(path), mode=0o700)
        os.symlink(tmp_path / "agent.sock", path)
        os.symlink(config["service"]["socket"] + ".lock", path + ".lock")
        with pytest.raises(KVStoreError):
            stop_service_now(load_config(planted), timeout_s=5.0)
        assert other.poll() is None
        assert service.info()["service_pid"]  # the service answers still
    finally:
        other.kill()
        other.wait()
        service.close()


# A listener that takes every connection and hangs it up at once (no kvstore service).
PLAIN_LISTENER = """
import socket, sys
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1])
listener.listen(8)
print("listening", flush=True)
while True:
    listener.accept()[0].close()
"""


def test_metrics_are_scraped_from_the_store(config):
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config["service"]["metrics_port"] = port
    config.update(disk_admission="learned", disk_write_budget="1TiB")
    client = StoreClient(load_config(config), CHUNK)
    keys = [bytes([i + 1]) * 16 for i in range(3)]
    assert client.put(keys, [0, 1, 2]) == [True] * 3
    assert client.get(keys, [3, 4, 5]) == [True] * 3
    with pytest.raises(KVStoreError, match="a client may add only"):  # names are bounded
        client.count({"made.up": 1})  # (and a name over 64 characters is no frame: protocol.py)
    client.close()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "made_up" not in text
    assert "kvstore_dram_hits_total 3.0" in text
    assert "kvstore_disk_bytes_written_total 0.0" in text  # all three still in DRAM: no SSD write
    assert "kvstore_disk_admission_refused_total 0.0" in text
    assert 'kvstore_disk_admission_threshold{policy="learned"} 0.0' in text  # from cold: nothing refused
    assert "kvstore_disk_admission_loss_budget 0.01" in text
    assert "kvstore_disk_admission_loss_measured 0.0" in text
    assert "kvstore_disk_write_budget_bytes_per_day 1.099511627776e+12" in text
    assert "kvstore_disk_write_budget_left_bytes" in text and "kvstore_disk_budget_refused_total 0.0" in text
    assert 'kvstore_tier_chunks{tier="dram"} 3.0' in text
    assert 'kvstore_read_latency_seconds{quantile="0.5",tier="dram"}' in text
    assert 'kvstore_read_seconds_bucket{le="+Inf",tier="dram"} 3.0' in text
    assert 'kvstore_read_seconds_count{tier="dram"} 3.0' in text
    disk_path = config["tiers"]["disk"][0]["path"]
    assert f'kvstore_device_in_service{{device="{disk_path}",kind="disk"}} 1.0' in text
    assert f'kvstore_device_trips_total{{device="{disk_path}",kind="disk"}} 0.0' in text


def test_info_asks_the_running_service(config, tmp_path, capsys):
    import json as json_module

    from kvstore.cli import main as cli_main

    path = tmp_path / "kvstore.json"
    path.write_text(json_module.dumps(config))
    assert cli_main(["info", "--config", str(path)]) == 2  # no service, no chunk size
    client = StoreClient(load_config(config), CHUNK)
    client.put([b"a" * 16], [0])
    capsys.readouterr()
    assert cli_main(["info", "--config", str(path), "--json"]) == 0
    info = json_module.loads(capsys.readouterr().out)
    assert info["chunk_bytes"] == CHUNK and info["tiers"][0]["chunks"] == 1
    client.close()


def test_a_lookup_with_prefetch_warms_dram(config):
    keys = [bytes([i + 1]) * 16 for i in range(4)]
    client = StoreClient(load_config(config), CHUNK)
    assert client.put(keys, [0, 1, 2, 3]) == [True] * 4
    client.shutdown()  # DRAM written down to disk
    client = StoreClient(load_config(config), CHUNK)
    assert client.residency(keys) == (4, 0, False)
    assert client.info()["tiers"][0]["chunks"] == 0  # DRAM empty after the restart
    stored, resident, pending = client.residency(keys, prefetch=True)
    assert (stored, resident) == (4, 0)
    deadline = time.monotonic() + 10
    while pending and time.monotonic() < deadline:
        time.sleep(0.05)
        stored, resident, pending = client.residency(keys)
    assert (stored, resident, pending) == (4, 4, False)  # promoted, and no longer pending
    assert client.info()["counters"]["prefetch.chunks"] == 4
    client.count({"prefetch.requests": 1})
    assert client.info()["counters"]["prefetch.requests"] == 1
    assert client.get(keys, [0, 1, 2, 3]) == [True] * 4
    assert client.info()["counters"]["dram.hits"] == 4
    client.close()


def test_one_residency_request_answers_for_every_rank(config):
    """A tensor-parallel prompt's keys differ per rank: a chunk counts where every rank has it."""
    rank0 = [bytes([i + 1]) * 16 for i in range(4)]
    rank1 = [bytes([i + 101]) * 16 for i in range(4)]
    client = StoreClient(load_config(config), CHUNK)
    assert client.put(rank0, [0, 1, 2, 3]) == [True] * 4
    assert client.put(rank1[:2], [0, 1]) == [True] * 2
    assert client.residency_ranks([rank0, rank1]) == (2, 2, False)
    assert client.residency_ranks([rank1, rank0]) == (2, 2, False)
    assert client.residency_ranks([rank0]) == (4, 4, False)
    client.close()


@pytest.mark.parametrize("mode", ["warm", "predict"])
def test_a_finished_conversation_is_back_in_dram_before_its_next_turn(config, mode):
    """`warm`: a finished request's chunks are promoted at once; `predict`: when a hint (or
    the learned gap) says its next turn comes, less the lead time."""
    keys = [bytes([i + 1]) * 16 for i in range(4)]
    config.update(next_turn=mode, next_turn_lead_s=0.2)  # the fixture stops this same service
    client = StoreClient(load_config(config), CHUNK)
    assert client.put(keys, [0, 1, 2, 3]) == [True] * 4
    client.shutdown()  # DRAM written down to disk, then gone
    client = StoreClient(load_config(config), CHUNK)
    assert client.residency(keys) == (4, 0, False)
    if mode == "warm":
        client.finished([keys])
    else:
        client.expect([keys], in_s=3.0)
        time.sleep(0.3)
        assert client.residency(keys)[1] == 0  # not yet: due 2.8 s from the hint
    deadline = time.monotonic() + 10
    while client.residency(keys)[1] < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.residency(keys)[:2] == (4, 4)
    client.close()


def test_misses_are_one_metric_labelled_by_tier_and_reason(tmp_path):
    from kvstore.format.record import MissReason
    from kvstore.service.metrics import StoreCollector
    from kvstore.store.tiered import TieredStore

    with TieredStore({"tiers": {"dram": {"capacity": "1MiB"}}}, CHUNK) as store:
        store.stats.miss("disk", MissReason.BAD_CHECKSUM, "a test")
        store.stats.miss("peer", MissReason.STALE, "a test")
        families = {f.name: f for f in StoreCollector(lambda: store).collect()}
    misses = {(s.labels["tier"], s.labels["reason"]): s.value for s in families["kvstore_misses"].samples}
    assert misses == {("disk", "bad_checksum"): 1, ("peer", "stale"): 1}
    assert not any("miss" in name for name in families if name != "kvstore_misses")


def test_every_counter_the_connector_reports_is_one_a_client_may_add():
    """The service refuses counter names outside a bounded set: a counter the connector
    core reports under another name would be lost without a sound."""
    import re
    from pathlib import Path

    from kvstore.service.counters import CLIENT_COUNTER

    root = Path(__file__).parents[1]
    source = "\n".join(p.read_text() for room in ("connectors", "engine_plugin/vllm/core")
                        for p in (root / room).glob("*.py"))
    loggers = set(re.findall(r'getLogger\("([^"]+)"\)', source))
    files = set(re.findall(r'"([a-z_]+\.json)"', source))  # the config files a weights fingerprint reads
    names = set(re.findall(r'"([a-z_]+\.[a-z_]+)"', source)) - loggers - files
    assert names and not [n for n in names if not CLIENT_COUNTER.fullmatch(n)]
