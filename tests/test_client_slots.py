"""The service's client slots, attacked through its socket by other local users: an allowed
user holds at most its share (`service.max_clients_per_user`), all of them together leave
the owner's reserve (`service.owner_reserved_clients`), and a connection that says no
hello within `service.hello_timeout_s` (silent, or a byte at a time) is closed; each
refusal and each closing is counted (`clients.*`, in `kvstore info` and Prometheus).

As root, throwaway unprivileged users (tests/support/users.py) run the attacks against
a real `kvstore serve` (spawned by the owner's first client); their code is the standard
library's sockets only, so it runs however private the checkout is.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import services
from support.cluster import get, put, wait_for
from support.stores import CHUNK_BYTES, make_keys, make_payloads
from support.users import User, cannot_make_users, shared_directory

from bench.support.processes import free_port
from kvstore.config.store import ServiceConfig, dump_config, load_config
from kvstore.format.errors import ConfigError, KVStoreError
from kvstore.service import protocol as P
from kvstore.service.client import StoreClient, stop_service
from kvstore.service.client_slots import REASONS, ClientSlots

# `count` connections, opened at once, that never send a byte; on a line from the test,
# how many the service still holds (a refused one has its refusal to read, and an end).
HOLD = """
import select, socket, sys
socks = []
for _ in range({count}):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect({path!r})
    socks.append(sock)
print("connected", flush=True)
sys.stdin.readline()
readable, _, _ = select.select(socks, [], [], 0)
print("held", len(socks) - len(readable), flush=True)
sys.stdin.readline()
"""

# `count` silent connections; how many the service closed within `wait_s`.
SILENT = """
import select, socket, time
socks = []
for _ in range({count}):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect({path!r})
    socks.append(sock)
alive, deadline = list(socks), time.monotonic() + {wait_s}
while alive and time.monotonic() < deadline:
    for sock in select.select(alive, [], [], 0.1)[0]:
        try:
            ended = not sock.recv(4096)
        except OSError:
            ended = True
        if ended:
            alive.remove(sock)
print("closed", len(socks) - len(alive), flush=True)
"""

# A frame of 1000 bytes announced, then its bytes one every 0.1 s: 15 s for 150 of them,
# within the 30 s a frame that has started may take.
DRIBBLE = """
import socket, struct, time
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect({path!r})
sent = 0
try:
    for byte in struct.pack(">I", 1000) + bytes(150):
        sock.send(bytes([byte]))
        sent += 1
        time.sleep(0.1)
    print("never cut", flush=True)
except OSError:
    print("cut after", sent, "bytes", flush=True)
"""


@pytest.fixture
def users() -> Iterator[Callable[[], User]]:
    """Makes throwaway unprivileged users on demand; removes them after."""
    reason = cannot_make_users()
    if reason:
        pytest.skip(reason)
    made: list[User] = []

    def make() -> User:
        made.append(User())
        return made[-1]

    yield make
    for user in made:
        user.remove()


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    with shared_directory() as path:
        yield path


@pytest.fixture
def owner(shared_tmp: Path) -> Iterator[Callable[..., StoreClient]]:
    """The owner's scheduler client (no window), which starts the service with the given
    `allowed_uids` and other `service` keys; the service is stopped after."""
    started: list[dict] = []
    clients: list[StoreClient] = []

    def start(*uids: int, **service: object) -> StoreClient:
        raw = services.service_config(shared_tmp, dram="4MiB", socket="run/kvstore.sock",
                                      allowed_uids=list(uids), **service)
        started.append(raw)
        clients.append(StoreClient(load_config(raw)))
        return clients[-1]

    yield start
    for client in clients:
        client.close()
    for raw in started:  # full or not (the clients just closed may still hold their slots)
        stop_service(load_config(raw))


def _counted(client: StoreClient, reason: str) -> int:
    return int(client.info()["counters"].get(f"clients.{reason}", 0))


def _hold(user: User, client: StoreClient, count: int) -> subprocess.Popen[str]:
    process = user.start(HOLD.format(count=count, path=client.config.service.socket))
    assert process.stdout is not None and process.stdout.readline() == "connected\n", process.communicate()
    return process


def _held(process: subprocess.Popen[str]) -> int:
    """How many of its connections the service holds (process: `_hold`'s)."""
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write("report\n")
    process.stdin.flush()
    return int(process.stdout.readline().split()[1])


def _serves(client: StoreClient, seed: int) -> None:
    """A store round trip through the client's window."""
    keys, payloads = make_keys(2, seed=seed), make_payloads(2, seed=seed)
    assert put(client, keys, payloads) == [True, True]
    client.memory.slot(0)[:] = bytes(CHUNK_BYTES)
    assert get(client, keys) == ([True, True], [p.tobytes() for p in payloads])


def test_an_allowed_user_holds_its_share_and_the_owner_still_connects_and_serves(users, owner):
    """One allowed user opens every connection the service serves and says nothing: it
    holds its share (2 of 8), the rest refused and counted; the owner's new engine
    connects and stores and loads meanwhile. (Before, it held all 8 for ever.)"""
    intruder = users()
    port = free_port()
    monitor = owner(intruder.uid, max_clients=8, max_clients_per_user=2, hello_timeout_s=300,
                    metrics_port=port)
    attack = _hold(intruder, monitor, 8)
    wait_for(lambda: _counted(monitor, "refused_user_share") == 6, 30, "six refusals")
    assert _held(attack) == 2
    engine = StoreClient(monitor.config, CHUNK_BYTES)
    try:
        _serves(engine, seed=1)
    finally:
        engine.close()
    assert _counted(monitor, "refused_full") == _counted(monitor, "refused_owner_reserve") == 0
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "kvstore_clients_refused_user_share_total 6.0" in text
    assert "kvstore_clients_hello_timeout_total 0.0" in text


def test_the_owner_reserve_holds_when_several_allowed_users_fill_their_shares(users, owner):
    """Three allowed users each open their share (3); together they may hold 8 less the
    owner's reserve of 2: six, the rest refused. The owner's engine connects into the
    reserve, and past max_clients even the owner is refused."""
    intruders = [users() for _ in range(3)]
    monitor = owner(*(user.uid for user in intruders), max_clients=8, max_clients_per_user=3,
                    owner_reserved_clients=2, hello_timeout_s=300)
    attacks = [_hold(user, monitor, 3) for user in intruders]
    wait_for(lambda: _counted(monitor, "refused_owner_reserve") == 3, 30, "three refusals")
    held = [_held(attack) for attack in attacks]
    assert sum(held) == 6 and max(held) <= 3
    engine = StoreClient(monitor.config, CHUNK_BYTES)  # the monitor and the engine: the reserve
    try:
        _serves(engine, seed=2)
        with pytest.raises(KVStoreError):  # its refusal, or a hang-up (read before its hello was sent)
            StoreClient(monitor.config)
    finally:
        engine.close()
    assert _counted(monitor, "refused_full") == 1 and _counted(monitor, "refused_user_share") == 0


def test_the_owner_stops_a_full_service_with_kvstore_stop(users, owner, shared_tmp):
    """Every slot held (an allowed user its share, the owner's clients the rest): the
    owner's `kvstore stop` still stops the service (its hello refused, the service is sent
    SIGTERM), which exits as it does on a stop: its socket unlinked, every connection
    ended. (Before, the stop was refused: "the service has 4 clients already".)"""
    intruder = users()
    monitor = owner(intruder.uid, max_clients=4, max_clients_per_user=2, owner_reserved_clients=1,
                    hello_timeout_s=300)
    attack = _hold(intruder, monitor, 2)
    engine = StoreClient(monitor.config, CHUNK_BYTES)
    try:
        with pytest.raises(KVStoreError):  # full: the monitor, the engine and the user's two
            StoreClient(monitor.config).close()
        config = shared_tmp / "kvstore.json"
        config.write_text(json.dumps(dump_config(monitor.config)))
        done = subprocess.run([sys.executable, "-m", "kvstore.cli", "stop", "--config", str(config)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "sending it SIGTERM" in done.stderr, done.stderr
        assert not Path(monitor.config.service.socket).exists()
        assert _held(attack) == 0
        assert not stop_service(monitor.config)  # nothing runs there now
    finally:
        engine.close()


def test_silent_connections_are_closed_at_the_hello_deadline_and_their_slots_come_back(users, owner):
    intruder = users()
    monitor = owner(intruder.uid, max_clients=8, max_clients_per_user=2, hello_timeout_s=1)
    code = SILENT.format(count=2, path=monitor.config.service.socket, wait_s=20)
    assert intruder.run(code).stdout.split() == ["closed", "2"]
    assert _counted(monitor, "hello_timeout") == 2  # the monitor, which said hello, still served
    assert intruder.run(code).stdout.split() == ["closed", "2"]  # its share is back: 2 more held
    assert _counted(monitor, "hello_timeout") == 4 and _counted(monitor, "refused_user_share") == 0


def test_a_client_dribbling_its_first_frame_is_cut_off_at_the_hello_deadline(users, owner):
    intruder = users()
    monitor = owner(intruder.uid, hello_timeout_s=1)
    done = intruder.run(DRIBBLE.format(path=monitor.config.service.socket))
    assert done.stdout.startswith("cut after"), (done.stdout, done.stderr)
    assert _counted(monitor, "hello_timeout") == 1


def test_a_user_not_allowed_is_refused_counted_and_logged_once(users, owner):
    """A user the config does not name, connecting again and again, is refused each time
    and counted; the service's log says so once, not once a connection."""
    allowed, stranger = users(), users()
    monitor = owner(allowed.uid)  # the socket's directory is passable: another user is allowed
    code = SILENT.format(count=1, path=monitor.config.service.socket, wait_s=20)
    for _ in range(3):
        assert stranger.run(code).stdout.split() == ["closed", "1"]
    assert _counted(monitor, "refused_not_allowed") == 3
    log = Path(monitor.config.service.socket + ".log").read_text()
    assert log.count(f"refused a client of uid {stranger.uid}") == 1, log


def test_requests_before_the_hello_do_not_move_its_deadline(owner):
    """Only a hello answered frees a connection from the deadline: one that asks for
    Info and then waits is closed."""
    monitor = owner(hello_timeout_s=1)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(monitor.config.service.socket)
    channel = P.Channel(sock)
    try:
        channel.send(P.Info())
        assert channel.recv(P.REPLY, 10).ok
        with pytest.raises(EOFError):
            channel.recv(P.REPLY, 20)
    finally:
        channel.close()
    assert _counted(monitor, "hello_timeout") == 1


# -- the accounting, over any sequence ---------------------------------------------------

OWNER, OTHERS, STRANGER = 1000, (1001, 1002, 1003), 2000


@st.composite
def _limits(draw) -> ServiceConfig:
    most = draw(st.integers(1, 10))
    return ServiceConfig(socket="/tmp/unused.sock", allowed_uids=OTHERS, max_clients=most,
                         max_clients_per_user=draw(st.integers(1, most)),
                         owner_reserved_clients=draw(st.integers(0, most - 1)))


@settings(max_examples=300, deadline=None)
@given(service=_limits(),
       steps=st.lists(st.tuples(st.sampled_from([OWNER, *OTHERS, STRANGER]), st.booleans()), max_size=60))
def test_slots_never_exceed_their_bounds_and_all_come_back(service, steps):
    """Connections opened (True) and closed (False) in any order: no other user past its
    share, all of them never into the owner's reserve, nobody past max_clients, and a
    refusal only where a bound was reached; every refusal counted once. Once all are
    closed, everything can be taken again."""
    slots = ClientSlots(service, OWNER, logging.getLogger("test"))
    held: Counter[int] = Counter()
    refused = 0
    for uid, opens in steps:
        if not opens:
            if held[uid]:
                slots.give_back(uid)
                held[uid] -= 1
            continue
        others = sum(held[other] for other in OTHERS)
        full = sum(held.values()) == service.max_clients
        bound = uid == STRANGER or full or (uid != OWNER and (
            held[uid] == service.user_share or others == service.max_clients - service.owner_reserve))
        if slots.take(uid, uid) is None:
            held[uid] += 1
            assert not bound
        else:
            refused += 1
            assert bound
        assert sum(held.values()) <= service.max_clients
        assert sum(held[other] for other in OTHERS) <= service.max_clients - service.owner_reserve
        assert all(held[other] <= service.user_share for other in OTHERS)
    counts = slots.counts.snapshot()
    assert sum(counts[f"clients.{reason}"] for reason in REASONS) == refused
    for uid, count in held.items():
        for _ in range(count):
            slots.give_back(uid)
    for uid in OTHERS:  # each user its share again, as far as the reserve leaves room
        room = min(service.user_share, service.max_clients - service.owner_reserve)
        assert [slots.take(uid, uid) is None for _ in range(room + 1)] == [True] * room + [False]
        for _ in range(room):
            slots.give_back(uid)
    assert [slots.take(OWNER, OWNER) is None for _ in range(service.max_clients + 1)] == (
        [True] * service.max_clients + [False])


# -- the settings ----------------------------------------------------------------------------

@pytest.mark.parametrize(("service", "field", "words"), [
    ({"max_clients": 4, "max_clients_per_user": 5}, "service.max_clients_per_user",
     "more than max_clients (4)"),
    ({"max_clients": 4, "owner_reserved_clients": 5}, "service.owner_reserved_clients",
     "more than max_clients (4)"),
    ({"max_clients": 4, "owner_reserved_clients": 4, "allowed_gids": [7]}, "service.owner_reserved_clients",
     "could never connect"),
    ({"max_clients_per_user": 0}, "service.max_clients_per_user", "between 1 and 65536"),
    ({"hello_timeout_s": 0}, "service.hello_timeout_s", "above 0"),
])
def test_shares_that_cannot_be_kept_are_clear_errors(service, field, words):
    with pytest.raises(ConfigError) as caught:
        load_config({"tiers": {"dram": {"capacity": "4MiB"}}, "service": service})
    assert caught.value.field == field and words in str(caught.value)


@pytest.mark.parametrize(("service", "share", "reserve"), [
    ({}, 64, 64), ({"max_clients": 2}, 1, 0), ({"max_clients": 4, "owner_reserved_clients": 4}, 1, 4),
    ({"max_clients": 8, "max_clients_per_user": 8, "allowed_uids": [7]}, 8, 2)])
def test_a_share_and_a_reserve_default_to_a_quarter_of_max_clients(service, share, reserve):
    config = load_config({"tiers": {"dram": {"capacity": "4MiB"}}, "service": service})
    assert (config.service.user_share, config.service.owner_reserve) == (share, reserve)
