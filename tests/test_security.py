"""kvstore on a shared host: each attack of a local user (or a buggy client) replayed.

As root, a throwaway unprivileged user is created for the test (and removed after);
its code runs in a subprocess with that uid. Every attack must fail safe: a clear
error or a miss, never code execution, never wrong KV, never a dead service.
The numbers are those of the issue that listed the attacks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
from support import services
from support.stores import CHUNK_BYTES, make_keys, make_payloads
from support.users import User, cannot_make_users, readable_packages, shared_directory

from bench.support.processes import free_port
from kvstore.config.store import load_config
from kvstore.devices.layout import SB_COPIES
from kvstore.format.errors import BadKeyError, ConfigError, DeviceError, KVStoreError, ShapeError
from kvstore.format.record import BLOCK, record_bytes
from kvstore.io.faulty import Fault, FaultyEngine
from kvstore.io.threads import ThreadsEngine
from kvstore.service import protocol as P
from kvstore.service.client import StoreClient, stop_service
from kvstore.store.tiered import TieredStore

SLOT = record_bytes(CHUNK_BYTES)

needs_root = pytest.mark.skipif(cannot_make_users() is not None, reason=str(cannot_make_users()))


# What the other user's code imports beside the standard library: the snapshot below holds
# the packages these load.
OTHERS_IMPORT = ("kvstore.config.store", "kvstore.format.errors", "kvstore.service.client")


@pytest.fixture(scope="session")
def others_pythonpath() -> Iterator[str]:
    """Where the other user's interpreter finds kvstore and what it imports (a readable copy)."""
    why = cannot_make_users()
    if why is not None:
        pytest.skip(why)
    with readable_packages(OTHERS_IMPORT) as path:
        yield path


@pytest.fixture
def intruder(others_pythonpath):
    """Another local user, unprivileged (in some tests the victim instead: see there)."""
    user = User(others_pythonpath)
    yield user
    user.remove()


@pytest.fixture
def shared_tmp():
    """A directory other users can reach (pytest's own are private to root)."""
    with shared_directory() as path:
        yield path


@pytest.fixture
def service_config(tmp_path, disk_dir):
    """A config whose service the test starts; stopped (and its leftovers killed) after."""
    raw = services.service_config(tmp_path, dram=4 * SLOT, disk_dir=disk_dir, disk=64 * SLOT,
                                  io={"timeout_s": 5}, socket="run/kvstore.sock")
    yield raw
    stop_service(load_config(raw))


def _service_pid(config: dict) -> int:
    client = StoreClient(load_config(config))
    try:
        return int(client.info()["service_pid"])
    finally:
        client.close()


def _raw_channel(config: dict) -> P.Channel:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(config["service"]["socket"])
    return P.Channel(sock)


def _hello(config: dict, chunk: int | None = CHUNK_BYTES) -> P.Hello:
    from kvstore.config.store import dump_config

    return P.Hello(P.PROTOCOL_VERSION, dump_config(load_config(config)), chunk)


# -- 1. socket squatting ------------------------------------------------------------------

@needs_root
def test_1_a_squatted_default_runtime_directory_is_refused(intruder, shared_tmp, others_pythonpath):
    """Another user pre-creates the victim's default runtime directory in /tmp and
    listens there: the victim's client refuses the directory instead of connecting."""
    victim = User(others_pythonpath)
    try:
        squat = f"/tmp/kvstore-{victim.uid}"
        made = intruder.run(f"import os; os.mkdir({squat!r}, 0o777); os.chmod({squat!r}, 0o777)")
        assert made.returncode == 0, made.stderr
        config = {"tiers": {"dram": {"capacity": "4MiB"}}}
        code = ("from kvstore.service.client import StoreClient\n"
                "from kvstore.config.store import load_config\n"
                f"StoreClient(load_config({config!r}), 65536)")
        done = victim.run(code, XDG_RUNTIME_DIR="")
        assert done.returncode != 0
        assert f"its directory {squat} is owned by uid {intruder.uid}" in done.stderr
    finally:
        shutil.rmtree(f"/tmp/kvstore-{victim.uid}", ignore_errors=True)
        victim.remove()


@needs_root
def test_1_a_client_refuses_a_listener_of_another_user(intruder, shared_tmp):
    """Whoever listens at the victim's socket must be the victim (SO_PEERCRED). Here the
    throwaway user is the victim, and root (the only other user who can reach its
    private directory) listens there, answering with a pickle that would run code."""
    victim = intruder
    run = shared_tmp / "run"
    run.mkdir(mode=0o700)
    os.chown(run, victim.uid, victim.gid)
    path = str(run / "kvstore.sock")
    marker = Path(f"/tmp/kvstore-pwned-{uuid.uuid4().hex}")  # a place the victim could write
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o666)
    listener.listen(1)
    payload = (b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")

    def answer() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            conn.sendall(struct.pack(">I", len(payload)) + payload)
            time.sleep(1)
            conn.close()

    import threading

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    config = {"tiers": {"dram": {"capacity": "4MiB"}}, "service": {"socket": path, "spawn": False}}
    code = ("from kvstore.service.client import StoreClient\nfrom kvstore.config.store import load_config\n"
            f"StoreClient(load_config({config!r}))")
    done = victim.run(code)
    listener.close()
    assert done.returncode != 0 and "runs as uid 0, not this user" in done.stderr
    assert not marker.exists()


# -- 2. no pickle on the wire; the socket is private from the first instant ---------------

def test_2_a_pickle_sent_to_the_service_runs_nothing(service_config, tmp_path):
    from multiprocessing.connection import Client

    StoreClient(load_config(service_config)).close()  # the service runs
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {shlex.quote(str(marker))}",))

    conn = Client(service_config["service"]["socket"], family="AF_UNIX")
    conn.send(("hello", Exploit()))
    with contextlib.suppress(EOFError, OSError):
        conn.recv_bytes()  # an error frame, then the service hangs up
    conn.close()
    time.sleep(0.5)
    assert not marker.exists()
    client = StoreClient(load_config(service_config), CHUNK_BYTES)  # still serving
    assert client.put(make_keys(1), [0]) == [True]
    client.close()


@needs_root
def test_2_another_user_cannot_reach_the_socket_even_under_umask_0(intruder, shared_tmp):
    path = str(shared_tmp / "run" / "kvstore.sock")
    config = load_config({"tiers": {"dram": {"capacity": "4MiB"}}, "service": {"socket": path}})
    old = os.umask(0)  # the client and the service it spawns both run under it
    try:
        StoreClient(config).close()
    finally:
        os.umask(old)
    try:
        assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
        done = intruder.run(f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({path!r})")
        assert "PermissionError" in done.stderr
    finally:
        stop_service(config)


def test_2_an_allowed_user_of_another_uid_gets_no_dram_tier_and_cannot_pin(intruder, shared_tmp):
    """Under the default share_dram (own-user) an engine of another allowed user loads
    through its window: it is not handed the DRAM tier, and a Pin from it is refused."""
    raw = services.service_config(shared_tmp, dram="4MiB", socket="run/kvstore.sock",
                                  allowed_uids=[intruder.uid])
    # Their engine trusts this user's service (listener and directory) and never spawns one.
    theirs = {**raw, "service": {**raw["service"], "allowed_uids": [os.geteuid()], "spawn": False}}
    owner = StoreClient(load_config(raw), CHUNK_BYTES)
    try:
        assert owner.memory.tier is not None  # the service's own user maps it
        assert os.stat(shared_tmp / "run").st_mode & 0o777 == 0o711  # others pass, not list
        owner.memory.slot(0)[:] = b"s" * CHUNK_BYTES
        assert owner.put([b"k" * 16], [0]) == [True]
        done = intruder.run(
            "import json, sys\n"
            "from kvstore.config.store import load_config\n"
            "from kvstore.format.errors import KVStoreError\n"
            "from kvstore.service.client import StoreClient\n"
            f"client = StoreClient(load_config(json.loads({json.dumps(theirs)!r})), {CHUNK_BYTES})\n"
            "print('tier', client.memory.tier is not None)\n"
            "try:\n"
            "    client.pin([b'k' * 16])\n"
            "    print('pinned')\n"
            "except KVStoreError as exc:\n"
            "    print('refused', exc)\n"
            "print('get', client.get([b'k' * 16], [0]), bytes(client.memory.slot(0)[:1]))\n")
        assert "tier False" in done.stdout, done.stderr
        assert "refused" in done.stdout and "not given the DRAM tier" in done.stdout
        assert "get [True] b's'" in done.stdout  # an allowed user still loads, through its window
    finally:
        owner.close()
        stop_service(load_config(raw))


def test_2_an_allowed_user_can_neither_stop_the_service_nor_make_its_store(intruder, shared_tmp):
    """An allowed user may use the service (docs/security.md), not run it: its Shutdown is
    refused, and its engine, first to connect, cannot fix the store's chunk size (nor have a
    fresh tier formatted for it): the store is made by the service's own user's engine."""
    raw = services.service_config(shared_tmp, dram="4MiB", socket="run/kvstore.sock",
                                  allowed_uids=[intruder.uid])
    theirs = {**raw, "service": {**raw["service"], "allowed_uids": [os.geteuid()], "spawn": False}}
    scheduler = StoreClient(load_config(raw))  # the owner's service, no store yet
    script = ("import json\n"
              "from kvstore.config.store import load_config\n"
              "from kvstore.format.errors import KVStoreError\n"
              "from kvstore.service.client import StoreClient\n"
              f"config = load_config(json.loads({json.dumps(theirs)!r}))\n"
              "for what in ('store', 'stop'):\n"
              "    try:\n"
              "        if what == 'store':\n"
              f"            StoreClient(config, {2 * CHUNK_BYTES})\n"
              "        else:\n"
              "            StoreClient(config).shutdown(timeout_s=5)\n"
              "        print(what, 'done')\n"
              "    except KVStoreError as exc:\n"
              "        print(what, 'refused:', exc)\n")
    try:
        done = intruder.run(script)
        assert "store refused: kvstore service: the store is made by the first engine of the service's own" \
            in done.stdout, done.stdout + done.stderr
        assert "stop refused: kvstore service: only the service's own user may stop it" in done.stdout
        owner = StoreClient(load_config(raw), CHUNK_BYTES)  # still up; the owner's chunk size is taken
        assert owner.info()["chunk_bytes"] == CHUNK_BYTES
        owner.close()
    finally:
        scheduler.close()
        stop_service(load_config(raw))


def test_2_a_refused_hello_names_the_keys_that_differ_not_the_config(service_config):
    """The hello error used to print the service's whole config, a Redis password in
    `cluster.index_url` included: now only the names of the keys that differ."""
    secret = {**service_config, "cluster": {"host_id": "a", "index_url": "redis://u:hunter2@127.0.0.1:1/0"}}
    StoreClient(load_config(secret)).close()  # no store made: the index is never dialled
    try:
        with pytest.raises(KVStoreError) as refused:
            StoreClient(load_config(service_config))
        assert "they differ in cluster" in str(refused.value)
        assert "hunter2" not in str(refused.value) and "tiers" not in str(refused.value)
    finally:
        stop_service(load_config(secret))


def test_2_an_allowed_user_may_announce_but_not_list_or_purge(intruder, shared_tmp):
    """`kvstore purge` deletes every user's records of a namespace: the service's owner only."""
    raw = services.service_config(shared_tmp, dram="4MiB", socket="run/kvstore.sock",
                                  allowed_uids=[intruder.uid])
    theirs = {**raw, "service": {**raw["service"], "allowed_uids": [os.geteuid()], "spawn": False}}
    owner = StoreClient(load_config(raw), CHUNK_BYTES)
    try:
        owner.memory.slot(0)[:] = b"s" * CHUNK_BYTES
        assert owner.put([b"k" * 16], [0], namespace=b"n" * 16) == [True]
        done = intruder.run(
            "import json\n"
            "from kvstore.config.store import load_config\n"
            "from kvstore.format.errors import KVStoreError\n"
            "from kvstore.service.client import StoreClient\n"
            f"client = StoreClient(load_config(json.loads({json.dumps(theirs)!r})))\n"
            "client.announce([(b'm' * 16, {'model': 'theirs'})])\n"
            "print('announced')\n"
            "for ask in (client.namespaces, lambda: client.purge([b'n' * 16], dry_run=False)):\n"
            "    try:\n"
            "        ask()\n"
            "        print('allowed')\n"
            "    except KVStoreError as exc:\n"
            "        print('refused', exc)\n")
        assert "announced" in done.stdout, done.stderr
        assert done.stdout.count("refused") == 2 and "allowed" not in done.stdout
        assert "for the service's owner" in done.stdout
        assert owner.residency([b"k" * 16])[0] == 1
        assert [e["uid"] for e in owner.namespaces()] == [intruder.uid]  # labelled by who said it
        assert owner.purge([b"n" * 16], dry_run=False)["removed"] == 1
    finally:
        owner.close()
        stop_service(load_config(raw))


# -- 3. squatted storage paths ------------------------------------------------------------

@needs_root
def test_3_a_tier_directory_owned_by_another_user_is_refused(intruder):
    """The victim's tier path sits in a shared place (/tmp here) and another user made
    it first, to read the cached KV and plant records."""
    tier = f"/tmp/kvstore-tier-{uuid.uuid4().hex}"
    try:
        made = intruder.run(f"import os; os.mkdir({tier!r}, 0o777); os.chmod({tier!r}, 0o777)")
        assert made.returncode == 0, made.stderr
        with pytest.raises(DeviceError, match=f"owned by uid {intruder.uid}"):
            TieredStore({"tiers": {"disk": [{"path": tier, "capacity": 8 * SLOT}]}}, CHUNK_BYTES)
        assert os.listdir(tier) == []  # nothing created in it
    finally:
        shutil.rmtree(tier, ignore_errors=True)


@needs_root
def test_3_a_planted_data_file_or_link_is_refused(intruder, shared_tmp):
    tier = shared_tmp / "tier"
    tier.mkdir(mode=0o777)
    tier.chmod(0o777)  # a careless mode: anyone may create files in it
    config = {"tiers": {"disk": [{"path": str(tier), "capacity": 8 * SLOT}]}}
    with pytest.raises(DeviceError, match="lets others write in it"):
        TieredStore(config, CHUNK_BYTES)
    tier.chmod(0o755)
    (tier / "kvstore.data").symlink_to(shared_tmp / "victim-file")
    with pytest.raises(DeviceError, match="symbolic link"):
        TieredStore(config, CHUNK_BYTES)
    (tier / "kvstore.data").unlink()
    planted = tier / "kvstore.data"
    planted.write_bytes(b"")
    os.chown(planted, intruder.uid, intruder.gid)
    with pytest.raises(DeviceError, match=f"owned by uid {intruder.uid}"):
        TieredStore(config, CHUNK_BYTES)
    planted.unlink()
    with TieredStore(config, CHUNK_BYTES) as store:  # ours, made 0600: nobody else reads the KV
        store.put_many(make_keys(1), make_payloads(1))
        assert os.stat(planted).st_mode & 0o777 == 0o600
        done = intruder.run(f"open({str(planted)!r}, 'rb').read(1)")
        assert "PermissionError" in done.stderr


def test_3_the_dram_slab_has_no_file_to_squat():
    with pytest.raises(ConfigError, match=r"shm_name.*removed"):
        load_config({"tiers": {"dram": {"capacity": "4MiB", "shm_name": "kvstore-slab"}}})


# -- 4. runtime files: private directory, no links followed, not world-readable ------------

def test_4_a_socket_in_a_world_writable_directory_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    config = load_config(services.service_config(shared, dram="4MiB", socket="kv.sock", staging=None))
    with pytest.raises(ConfigError, match="others may create files in it"):
        StoreClient(config)


def test_4_the_log_lock_and_config_are_private_files(service_config):
    pid = _service_pid(service_config)
    path = service_config["service"]["socket"]
    for suffix in (".log", ".lock", ".json"):
        st = os.lstat(path + suffix)
        assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid(), suffix
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    # 9 (argv): the config is in that 0600 file, not on the command line every user can read
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    assert "tiers" not in cmdline and service_config["tiers"]["disk"][0]["path"] not in cmdline


# -- 5. the window is a descriptor the service made: no name to traverse --------------------

def test_5_a_hello_naming_a_window_file_is_refused(service_config):
    StoreClient(load_config(service_config)).close()
    channel = _raw_channel(service_config)
    hello = msgspec.msgpack.encode({"type": "hello", "version": P.PROTOCOL_VERSION, "config": {},
                                    "chunk_bytes": CHUNK_BYTES, "window": "../../etc/passwd"})
    channel.sock.sendall(struct.pack(">I", len(hello)) + hello)
    reply = channel.recv(P.REPLY, 10)
    assert not reply.ok and "window" in reply.error
    channel.close()


# -- 6. one client cannot stop or starve the service ----------------------------------------

def test_6_running_out_of_descriptors_does_not_end_the_service(service_config):
    import resource

    pid = _service_pid(service_config)
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (64, hard))
    held = []
    try:
        for _ in range(100):  # past the limit: accept() fails with EMFILE
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(service_config["service"]["socket"])
            held.append(sock)
        time.sleep(1)
    finally:
        for sock in held:
            sock.close()
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    deadline = time.monotonic() + 10
    while True:
        try:
            assert _service_pid(service_config) == pid
            break
        except KVStoreError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_6_a_client_truncating_its_window_cannot_crash_the_service(service_config):
    _service_pid(service_config)
    channel = _raw_channel(service_config)
    channel.send(_hello(service_config))
    assert channel.recv(P.REPLY, 30).ok
    fd = channel.take_fd()
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)  # sealed: the service's mapping keeps its size
    os.close(fd)
    channel.send(P.Put(make_keys(1), [0]))
    assert channel.recv(P.REPLY, 10).ok
    channel.close()
    assert _service_pid(service_config)


def test_6_bad_puts_leak_no_slots(service_config):
    client = StoreClient(load_config(service_config), CHUNK_BYTES)
    not_bytes = msgspec.msgpack.encode({"type": "put", "keys": ["not bytes"], "slots": [0]})
    short = msgspec.msgpack.encode(P.Put([b"short"], [0]))
    for _ in range(10):
        for frame, why in ((not_bytes, "keys"), (short, "`bytes` of length >= 16")):
            channel = _raw_channel(service_config)  # a frame that is not one ends its connection
            channel.send(_hello(service_config))
            channel.recv(P.REPLY, 30)
            channel.sock.sendall(struct.pack(">I", len(frame)) + frame)
            reply = channel.recv(P.REPLY, 10)
            assert not reply.ok and why in reply.error
            channel.close()
    keys = make_keys(4)
    for i in range(len(keys)):
        client.memory.slot(i)[:] = make_payloads(1, seed=i)[0]
    assert client.put(keys, [0, 1, 2, 3]) == [True] * 4
    assert client.info()["tiers"][0]["chunks"] == 4  # every DRAM slot is still there to take
    client.close()


def test_6_a_huge_frame_is_refused_before_it_is_buffered(service_config):
    pid = _service_pid(service_config)
    rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    channel = _raw_channel(service_config)
    channel.sock.sendall(struct.pack(">I", 512 << 20) + b"x" * 4096)
    reply = channel.recv(P.REPLY, 10)
    assert not reply.ok and "over the" in reply.error
    channel.close()
    assert int(Path(f"/proc/{pid}/statm").read_text().split()[1]) - rss < (64 << 20) // 4096
    assert _service_pid(service_config) == pid


# -- 7. descriptors stay flat under client churn ----------------------------------------------

@pytest.mark.parametrize("engine", ["uring", "threads"])
def test_7_descriptors_stay_flat_after_200_short_lived_clients(service_config, engine):
    service_config["io"]["engine"] = engine
    del service_config["tiers"]["dram"]  # every put and get goes to the disk, on the client's thread
    config = load_config(service_config)
    first = StoreClient(config, CHUNK_BYTES)
    pid = int(first.info()["service_pid"])
    first.close()
    baseline = len(os.listdir(f"/proc/{pid}/fd"))
    for i in range(200):
        client = StoreClient(config, CHUNK_BYTES)
        key = make_keys(1, seed=i)
        assert client.put(key, [0]) == [True] and client.get(key, [1]) == [True]
        client.close()
    deadline = time.monotonic() + 10  # each client's thread closes its descriptors as it ends
    while len(os.listdir(f"/proc/{pid}/fd")) > baseline + 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(os.listdir(f"/proc/{pid}/fd")) <= baseline + 4


# -- 8. a second `kvstore serve` cannot steal a live service's socket -------------------------

def test_8_serve_refuses_a_socket_that_a_live_service_holds(service_config, tmp_path):
    pid = _service_pid(service_config)
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(service_config))
    second = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--config", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 2 and "already runs" in second.stderr
    assert _service_pid(service_config) == pid  # untouched, still answering
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while os.path.exists(service_config["service"]["socket"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(service_config["service"]["socket"])  # it ended cleanly
    log = Path(service_config["service"]["socket"] + ".log").read_text()
    assert "Traceback" not in log


# -- 9. input checked at the edge; a damaged superblock is not fatal ---------------------------

def test_9_a_get_into_a_read_only_buffer_is_refused(store_factory):
    store = store_factory({"tiers": {"dram": {"capacity": 8 * SLOT}}})
    store.put_many(make_keys(1), make_payloads(1))
    out = np.zeros(CHUNK_BYTES, np.uint8)
    out.flags.writeable = False
    with pytest.raises(ShapeError, match="read-only"):
        store.get_many(make_keys(1), [out])


@pytest.mark.parametrize("key", [b"short", "a str key", b"x" * 17, 7])
def test_9_keys_of_the_wrong_kind_are_refused_and_reserve_nothing(store_factory, key):
    store = store_factory({"tiers": {"dram": {"capacity": 2 * SLOT}}})
    for call in (lambda: store.put_many([key], make_payloads(1)),
                 lambda: store.get_many([key], [np.zeros(CHUNK_BYTES, np.uint8)]),
                 lambda: store.lookup([key])):
        with pytest.raises(BadKeyError, match="chunk keys are 16 bytes"):
            call()
    assert store.put_many(make_keys(2), make_payloads(2)) == [True, True]
    assert store.lookup(make_keys(2)).tiers == ("dram", "dram")


def test_9_a_dtype_name_too_long_is_refused_before_any_slot_is_taken(store_factory):
    with pytest.raises(ShapeError, match=r"float8_e4m3fn.*19 bytes"):
        store_factory({"tiers": {"dram": {"capacity": 2 * SLOT}}}, dtype="torch.float8_e4m3fn")


def test_9_a_chunk_size_that_rounds_to_the_same_slot_is_refused(disk_dir, store_factory):
    config = {"tiers": {"disk": [{"path": disk_dir, "capacity": 16 * SLOT}]}}
    store_factory(config).close()
    with pytest.raises(DeviceError, match="chunks"):
        store_factory(config, chunk_bytes=CHUNK_BYTES - 100)  # same 4 KiB-rounded slot size


@pytest.mark.parametrize("damaged", [(0,), (0, 1)], ids=["one-copy", "both-copies"])
def test_9_a_bad_superblock_bit_keeps_the_tier_and_its_records(disk_dir, store_factory, damaged):
    config = {"tiers": {"disk": [{"path": disk_dir, "capacity": 16 * SLOT}]}}
    keys, payloads = make_keys(3), make_payloads(3)
    store = store_factory(config)
    assert all(store.put_many(keys, payloads))
    store.close()
    with open(os.path.join(disk_dir, "kvstore.data"), "r+b") as raw:
        for copy in damaged:
            raw.seek(copy * BLOCK + 40)
            byte = raw.read(1)
            raw.seek(copy * BLOCK + 40)
            raw.write(bytes([byte[0] ^ 0x10]))
    reopened = store_factory(config)
    outs = [np.zeros(CHUNK_BYTES, np.uint8) for _ in keys]
    assert reopened.get_many(keys, outs) == [True] * 3
    assert all(np.array_equal(o, p) for o, p in zip(outs, payloads, strict=True))
    assert reopened.probe.recovery()["scanned"] == (1 if len(damaged) == SB_COPIES else 0)


def test_9_a_dram_tier_too_large_names_the_field():
    with pytest.raises(ConfigError, match=r"tiers.dram.capacity.*more than this machine's memory"):
        TieredStore({"tiers": {"dram": {"capacity": "1024TiB"}}}, CHUNK_BYTES)


def test_9_metrics_listen_on_loopback_only(service_config):
    port = free_port()  # one the kernel never hands out by itself before the service binds it
    service_config["service"]["metrics_port"] = port
    _service_pid(service_config)
    listening = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    local = [fields[1] for fields in listening if fields[3] == "0A" and
             int(fields[1].split(":")[1], 16) == port]
    assert local == [f"0100007F:{port:04X}"]  # 127.0.0.1, not 0.0.0.0


def test_9_a_crash_mid_write_after_a_clean_restart_leaves_no_valid_header_over_other_bytes(
        disk_dir, store_factory):
    """A slot that is free after a clean restart may still hold an old record's valid
    header (here: one dropped for bit rot). A write into it must zero that header before
    the payload: a crash before the new header then leaves an empty slot, not the old
    header over the new bytes."""
    from kvstore.store.fsck import fsck

    config = {"tiers": {"disk": [{"path": disk_dir, "capacity": 16 * SLOT}]}, "io": {"queue_depth": 4}}
    keys, payloads = make_keys(4), make_payloads(4)
    store = store_factory(config)
    assert all(store.put_many(keys[:3], payloads[:3]))
    offset = store.probe.where(keys[0]).offset
    assert offset is not None and offset == store.probe.devices()[0].data_offset  # its device's slot 0
    with open(os.path.join(disk_dir, "kvstore.data"), "r+b") as raw:
        raw.seek(offset + BLOCK + 10)  # a payload byte: bit rot
        raw.write(b"\xff\x00\xff")
    assert store.get_many(keys[:1], [np.zeros(CHUNK_BYTES, np.uint8)]) == [False]
    store.close()  # the checkpoint lists two records; slot 0 is free, its header valid
    faulty = FaultyEngine(ThreadsEngine(4))
    reopened = store_factory(config, engine=faulty)
    assert reopened.probe.recovery()["from_checkpoint"] == 1 and reopened.probe.recovery()["records"] == 2
    faulty.add(Fault("error", reads=False, writes=True,  # the new header never lands: the crash
                     match=lambda r: r.nbytes == BLOCK and any(r.buffers[0][:4])))
    assert reopened.put_many(keys[3:], payloads[3:]) == [False]
    reopened.simulate_crash()
    faulty.close()
    assert fsck(disk_dir) == {"valid": 2, "corrupt": 0, "torn": 0, "empty": 13}  # of 15 slots
