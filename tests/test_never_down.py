"""Never down: no input from outside takes the scheduler's thread, the service or its
next-turn thread down. Each parser at a boundary is fuzzed (hypothesis): a request's
kv_transfer_params and KV hints, the prefill handoff, and every frame of the service's
protocol against a real service. What does not parse is counted as malformed, never
raised; the service keeps serving, and leaks no descriptor, thread or /dev/shm file.
(Through a real vLLM scheduler: test_connector_guard.py; the OpenAI server:
test_vllm_server.py; config files on reload: test_reload.py.)"""

from __future__ import annotations

import array
import contextlib
import logging
import math
import os
import socket
import struct
import time
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace as NS

import msgspec
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from support.services import service_config, stop_service
from support.stores import CHUNK_BYTES

from engine_plugin.vllm.core.handoff import MAX_CHUNKS, PARAMS_KEY, Handoff
from engine_plugin.vllm.core.hints import (
    MAX_EXPECT_S,
    MAX_HINTS,
    PREFETCH_KEY,
    Hint,
    HintLimits,
    action_hint,
    prefetch_hints,
)
from engine_plugin.vllm.core.plan import StepPlan, Transfer
from kvstore.config.store import load_config
from kvstore.format.errors import ConfigError
from kvstore.format.malformed import Malformed, MalformedCounts
from kvstore.service import protocol as P
from kvstore.service.client import StoreClient
from kvstore.service.next_turns import NextTurns
from kvstore.tiers.next_turn import NextTurnPredictor

LIMITS = HintLimits(max_tokens=64, vocab=512)
SCALARS = (st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=6)
           | st.sampled_from([math.inf, -math.inf, math.nan, 1e999, "1", "x", 511, 512, -1, 0]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=6)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=24)
TOKENS = st.lists(st.integers(-2, 514) | SCALARS, max_size=70)  # mostly near-valid token lists
HINT_VALUES = JSON | TOKENS | st.lists(TOKENS, max_size=10)
HANDOFFS = JSON | st.fixed_dictionaries({
    "chunks": st.integers(-1, MAX_CHUNKS + 1) | SCALARS,
    "last_key": st.sampled_from(["ab" * 16, "zz" * 16, "ab" * 15, "AB" * 16]) | SCALARS,
    "host": st.none() | st.text(max_size=300) | SCALARS})


def _valid(hint: Hint) -> bool:
    in_range = all(type(t) is int and 0 <= t < LIMITS.vocab for t in hint.tokens)
    good_time = hint.in_s is None or (math.isfinite(hint.in_s) and 0 <= hint.in_s <= MAX_EXPECT_S)
    return 0 < len(hint.tokens) <= LIMITS.max_tokens and in_range and good_time


# -- a request's params and hints: parsed on vLLM's scheduler thread --------------------

@given(st.one_of(JSON, st.fixed_dictionaries({PREFETCH_KEY: HINT_VALUES})))
def test_prefetch_token_lists_parse_or_are_malformed(params):
    try:
        hints = prefetch_hints(params, LIMITS)
    except Malformed as exc:
        assert exc.kind == "kv_transfer_params"
        return
    assert len(hints) <= MAX_HINTS and all(_valid(h) and h.in_s is None for h in hints)


@given(st.sampled_from(["fetch", "expect", "evict", 5, None]),
       JSON | st.fixed_dictionaries({"token_ids": HINT_VALUES, "in_s": SCALARS}))
def test_a_kv_hint_action_parses_or_is_malformed(kind, payload):
    try:
        hint = action_hint(kind, payload, LIMITS)
    except Malformed as exc:
        assert exc.kind == "kv_hints" and kind in ("fetch", "expect")
        return
    assert (hint is None) == (kind not in ("fetch", "expect"))
    assert hint is None or _valid(hint)


@given(st.one_of(JSON, st.fixed_dictionaries({PARAMS_KEY: HANDOFFS})))
def test_a_handoff_parses_or_is_malformed(params):
    try:
        handoff = Handoff.from_params(params)
    except Malformed as exc:
        assert exc.kind == "handoff"
        return
    if handoff is not None:
        assert 1 <= handoff.chunks <= MAX_CHUNKS and len(handoff.last_key) == 16
        assert Handoff.from_params(handoff.params()) == handoff  # what a producer sends round-trips


def test_the_bodies_that_killed_a_server_are_malformed_not_raised():
    for params in ({PREFETCH_KEY: "x"}, {PREFETCH_KEY: {"a": 1}}, {PREFETCH_KEY: 5},
                   {PREFETCH_KEY: [["1", None]]}, {PREFETCH_KEY: [[math.inf]]}):
        with pytest.raises(Malformed, match="kvstore_prefetch_token_ids"):
            prefetch_hints(params, LIMITS)
    with pytest.raises(Malformed, match="chunks must be an integer"):
        Handoff.from_params({PARAMS_KEY: {"chunks": math.inf, "last_key": "ab" * 16}})
    with pytest.raises(Malformed, match="in_s must be a number"):
        action_hint("expect", {"token_ids": [1], "in_s": "abc"}, LIMITS)
    assert prefetch_hints({PREFETCH_KEY: [[7] * 64] * MAX_HINTS}, LIMITS)[0] == Hint([7] * 64)
    with pytest.raises(Malformed, match=f"at most {MAX_HINTS}"):
        prefetch_hints({PREFETCH_KEY: [[7]] * (MAX_HINTS + 1)}, LIMITS)


actions = st.lists(st.builds(NS, action_type=st.sampled_from(["fetch", "expect", "evict"]) | SCALARS,
                             payload=JSON | st.fixed_dictionaries({"token_ids": TOKENS, "in_s": SCALARS})),
                   max_size=12)


@settings(deadline=None)  # the first example imports vLLM
@given(JSON | st.fixed_dictionaries({PREFETCH_KEY: HINT_VALUES}), st.none() | actions | JSON)
def test_a_requests_hints_never_raise_and_are_bounded(params, envelope_actions):
    pytest.importorskip("vllm")
    from engine_plugin.vllm.scheduler_role import request_hints

    counters: Counter[str] = Counter()
    request = NS(kv_transfer_params=params, kv_hints=NS(actions=envelope_actions))
    hints = request_hints(request, LIMITS, MalformedCounts(logging.getLogger("test"), counters))
    assert len(hints) <= MAX_HINTS and all(_valid(h) for h in hints)
    assert set(counters) <= {"malformed.kv_transfer_params", "malformed.kv_hints"}


def test_each_kind_of_malformed_input_is_logged_once_and_counted_each_time(caplog):
    counters: Counter[str] = Counter()
    malformed = MalformedCounts(logging.getLogger("kvstore.test"), counters)
    with caplog.at_level(logging.DEBUG, logger="kvstore.test"):
        for _ in range(3):
            malformed.count(Malformed("kv_hints", "bad"))
        malformed.count(Malformed("handoff", "bad"))
    assert counters == {"malformed.kv_hints": 3, "malformed.handoff": 1}
    assert [r.levelname for r in caplog.records] == ["WARNING", "DEBUG", "DEBUG", "WARNING"]


def test_a_given_up_request_is_never_half_loaded():
    """StepPlan.give_up: the request's loads become loads without keys over the same blocks
    (workers report them failed: test_connector_serving.py), the others' stay as they were."""
    keys = ((b"k" * 16,),)
    plan = StepPlan(loads=[Transfer("r", keys, (None,), ((1, 2),)), Transfer("s", keys, (None,), ((3, 4),)),
                           Transfer("r", keys, (None,), ((5,),), group=1)])
    plan.give_up("r")
    assert [(t.req_id, t.keys, t.blocks, t.group) for t in plan.loads] == [
        ("s", keys, ((3, 4),), 0), ("r", (), ((1, 2),), 0), ("r", (), ((5,),), 1)]
    plan.give_up("t", blocks=[[7, 8], [], [9]])  # allocated for a hit, its load never planned
    assert [(t.blocks, t.group) for t in plan.loads if t.req_id == "t"] == [(((7, 8),), 0), (((9,),), 2)]


YAML_TEXT = st.text(alphabet=st.sampled_from(list("abcdeiorstu:_-{}[],&*!#|>'\"\n 0123456789.")),
                    max_size=200)
TOP_KEYS = st.sampled_from(["tiers", "io", "service", "eviction", "chunk_tokens", "cluster", "x"])
CONFIG_FILES = st.one_of(st.binary(max_size=200), YAML_TEXT.map(str.encode),
                         st.builds(lambda tree: yaml.safe_dump(tree).encode(),
                                   st.dictionaries(TOP_KEYS, JSON, max_size=4)))


@settings(max_examples=300, deadline=None)
@given(CONFIG_FILES)
def test_any_config_file_loads_or_is_a_config_error(tmp_path_factory, content):
    """What a SIGHUP reload reads (server.reread catches anything else too, as a last resort)."""
    path = tmp_path_factory.getbasetemp() / "fuzzed.yaml"
    path.write_bytes(content)
    with contextlib.suppress(ConfigError):
        load_config(str(path))


def test_the_services_own_counters_are_scraped_before_any_store():
    from kvstore.service.metrics import StoreCollector

    families = {f.name: f for f in StoreCollector(lambda: None, lambda: {"malformed.frame": 2}).collect()}
    assert families["kvstore_malformed_frame"].samples[0].value == 2


# -- the next-turn thread ---------------------------------------------------------------

def test_a_hint_in_inf_or_nan_seconds_reaches_no_timer():
    promoted: list[tuple[bytes, ...]] = []
    turns = NextTurns("predict", 0.0, lambda keys, uid: promoted.append(keys))
    try:
        for in_s in (math.inf, math.nan, -1.0, MAX_EXPECT_S * 2):
            with pytest.raises(ValueError, match="in_s"):
                turns.expect([[b"a" * 16]], in_s)
        turns.expect([[b"b" * 16]], 0.0)
        _until(lambda: promoted == [(b"b" * 16,)])
    finally:
        turns.close()
    predictor = NextTurnPredictor()
    predictor.expect([b"c" * 16], math.inf)
    predictor.expect([b"d" * 16], math.nan)
    assert predictor.next_due() is None


def test_a_failing_promotion_does_not_end_predictions():
    promoted: list[tuple[bytes, ...]] = []

    def promote(keys: tuple[bytes, ...], uid: int | None) -> None:
        if keys == (b"x" * 16,):
            raise OSError("a promotion that fails")
        promoted.append(keys)

    turns = NextTurns("predict", 0.0, promote)
    try:
        turns.expect([[b"x" * 16]], 0.0)
        time.sleep(0.2)
        turns.expect([[b"y" * 16]], 0.0)
        _until(lambda: promoted == [(b"y" * 16,)])
    finally:
        turns.close()


def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.02)


# -- the service's protocol, against a real service -------------------------------------

@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[dict]:
    folder = tmp_path_factory.mktemp("never-down")
    raw = service_config(folder, dram="4MiB", io={"timeout_s": 5}, socket="run/kvstore.sock")
    yield raw
    stop_service(raw)


@pytest.fixture(scope="module")
def good(service) -> Iterator[StoreClient]:
    """A data client that stays connected through every bad frame the others send."""
    client = StoreClient(load_config(service), CHUNK_BYTES)
    yield client
    client.close()


def _exchange(config: dict, body: bytes) -> P.Reply | None:
    """Send one frame on a connection of its own: the reply, or None if the service hung up."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(config["service"]["socket"])
    channel = P.Channel(sock)
    try:
        sock.sendall(struct.pack(">I", len(body)) + body)
        return channel.recv(P.REPLY, 10)  # type: ignore[no-any-return]
    except (EOFError, ConnectionError):
        return None
    finally:
        channel.close()


def _malformed_frames(client: StoreClient) -> int:
    return int(client.info()["counters"].get("malformed.frame", 0))


def _footprint(pid: int) -> tuple[int, int, set[str]]:
    """The service's descriptors and threads, and the /dev/shm files it holds open or mapped
    (kvstore's shared memory is memfds, named nowhere; the other tests of a CI run make and
    remove /dev/shm files of their own meanwhile, so the whole folder is no baseline)."""
    held = set()
    for folder in ("fd", "map_files"):
        for entry in os.listdir(f"/proc/{pid}/{folder}"):
            with contextlib.suppress(OSError):  # closed or unmapped meanwhile
                target = os.readlink(f"/proc/{pid}/{folder}/{entry}")
                if target.startswith("/dev/shm/"):
                    held.add(target)
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task")), held


# Never "shutdown": the owner may send it (allowed users may not: test_security.py).
TAGS = ["hello", "residency", "finished", "expect", "count", "get", "put", "pin", "unpin", "info", "events",
        "nonsense"]
# What msgpack can encode (its ints are 64-bit): JSON values as a peer could send them.
WIRE_SCALARS = (st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
                | st.text(max_size=6) | st.sampled_from([math.inf, math.nan, -1, 0, 1 << 63]))
WIRE = st.recursive(WIRE_SCALARS, lambda inner: st.lists(inner, max_size=6)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=24)
FIELD_VALUES = (WIRE | st.binary(max_size=20) | st.lists(st.binary(min_size=15, max_size=17), max_size=4)
                | st.lists(st.lists(st.binary(min_size=16, max_size=16), max_size=3), max_size=3)
                | st.fixed_dictionaries({"type": st.just("unpin"), "leases": st.lists(st.integers(-1, 9),
                                                                                        max_size=3)},
                                        optional={"good": st.lists(st.binary(min_size=16, max_size=16),
                                                                   max_size=2)}))
FIELDS = ["version", "config", "chunk_bytes", "namespace", "dtype", "shape", "ranks", "prefetch", "in_s",
          "await_s", "lease_from", "release", "unread", "counters", "keys", "slots", "parent", "leases",
          "unpin", "since", "extra"]
FRAMES = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda tag, fields: msgspec.msgpack.encode({"type": tag, **fields}), st.sampled_from(TAGS),
              st.dictionaries(st.sampled_from(FIELDS), FIELD_VALUES, max_size=4)))


@settings(max_examples=150, deadline=None)
@given(body=FRAMES)
def test_no_frame_takes_the_service_down(service, good, body):
    before = _malformed_frames(good)
    reply = _exchange(service, body)
    after = _malformed_frames(good)  # the next good request is served
    if reply is None or (not reply.ok and reply.error.startswith("not a message")):
        assert after == before + 1, (reply, body)
    else:
        assert after == before


def test_fuzzed_frames_leak_no_descriptor_thread_or_shm_file(service, good):
    """Runs after the fuzz above: against a footprint taken before more of the same."""
    pid = int(good.info()["service_pid"])
    baseline = _footprint(pid)
    bodies = (b"", b"\xc1", msgspec.msgpack.encode({"type": "get", "keys": [b"k" * 16], "slots": [1 << 41]}),
              msgspec.msgpack.encode({"type": "expect", "ranks": [[b"k" * 16]], "in_s": math.nan}),
              msgspec.msgpack.encode(P.Hello(P.PROTOCOL_VERSION, {"tiers": 1}, CHUNK_BYTES)))
    for body in bodies * 20:
        _exchange(service, body)
    _until(lambda: _footprint(pid)[:2] <= baseline[:2])  # client threads end with their connections
    assert _footprint(pid)[2] == baseline[2]
    good.memory.slot(0)[:] = b"g" * CHUNK_BYTES
    assert good.put([b"g" * 16], [0]) == [True] and good.get([b"g" * 16], [1]) == [True]


def test_a_message_nested_a_million_deep_ends_its_connection_not_a_thread(service, good):
    before = _malformed_frames(good)
    deep = b"\x82\xa4type\xa5hello\xa6config" + b"\x81\xa1a" + b"\x91" * 1_000_000 + b"\x90"
    reply = _exchange(service, deep)
    assert reply is not None and not reply.ok and "nested too deeply" in reply.error
    assert _malformed_frames(good) == before + 1


def test_an_expect_of_inf_or_nan_seconds_is_refused_at_the_frame(service, good):
    for in_s in (math.inf, math.nan, -1.0):
        body = msgspec.msgpack.encode({"type": "expect", "ranks": [[b"k" * 16]], "in_s": in_s})
        reply = _exchange(service, body)
        assert reply is not None and "in_s" in reply.error
    with pytest.raises(Exception, match="in_s"):  # the client refuses to send one
        good.expect([[b"k" * 16]], math.inf)
    good.expect([[b"k" * 16]], 1.0)


def test_a_residency_awaiting_inf_nan_or_too_many_seconds_is_refused_at_the_frame(service, good):
    for await_s in (math.inf, math.nan, -1.0, P.MAX_AWAIT_S * 2):
        body = msgspec.msgpack.encode({"type": "residency", "ranks": [[b"k" * 16]], "await_s": await_s})
        reply = _exchange(service, body)
        assert reply is not None and "await_s" in reply.error
    # The client asks for at most the bound.
    assert good.residency_ranks([[b"k" * 16]], await_s=P.MAX_AWAIT_S * 2) == (0, 0, False)


def test_a_residency_of_300000_keys_is_answered_on_the_same_connection(service, good):
    """More keys than one frame carries (2 ranks x 300,000 x 18 bytes of msgpack): the
    client asks a piece at a time; nothing is refused and the link is not dropped."""
    before = _malformed_frames(good)
    keys = [i.to_bytes(16, "big") for i in range(1, 300_001)]
    assert good.residency_ranks([keys, keys]) == (0, 0, False)
    assert good.finished([keys, keys]) is None  # told by its leading part
    assert _malformed_frames(good) == before


def test_pieces_of_a_split_residency_add_up(service, good, monkeypatch):
    keys = [bytes([i + 1]) * 16 for i in range(5)]
    for i in range(5):
        good.memory.slot(i)[:] = bytes([i]) * CHUNK_BYTES
    assert good.put(keys, list(range(5))) == [True] * 5
    monkeypatch.setattr(P, "MAX_KEYS", 4)  # pieces of two chunks for two ranks
    assert good.residency_ranks([[*keys, b"z" * 16], keys]) == (5, 5, False)
    assert good.residency_ranks([[*keys[:3], b"z" * 16, *keys[4:]], keys]) == (3, 3, False)


def test_counters_from_a_client_are_bounded(service, good):
    too_many = {f"save.c{i}": 1 for i in range(300)}
    for counters in ({"x" * 65: 1.0}, {"save.x": math.nan}, {"save.x": -1.0}, too_many):
        reply = _exchange(service, msgspec.msgpack.encode({"type": "count", "counters": counters}))
        assert reply is not None and reply.error.startswith("not a message")
    good.count({"malformed.kv_hints": 1, "connector.faults": 1})  # the connector's own names
    counters = good.info()["counters"]
    assert counters["malformed.kv_hints"] >= 1 and counters["connector.faults"] >= 1


def test_a_reply_past_its_deadline_is_a_timeout_and_one_already_there_is_read():
    """A deadline that has passed reads what has arrived and otherwise says the time is up
    (TimeoutError, which the client reports as no answer, not as a lost connection)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    channel = P.Channel(ours)
    try:
        with pytest.raises(TimeoutError):
            channel.recv(P.REPLY, 0.0)
        P.Channel(theirs).send(P.Reply(True, 7))
        assert channel.recv(P.REPLY, 0.0).value == 7
    finally:
        channel.close()
        theirs.close()


def test_descriptors_a_client_attaches_to_its_frames_are_not_kept(service, good):
    """A client may pass descriptors with any frame (SCM_RIGHTS); the service takes none.
    Kept until the connection closed, 4 a piece filled the service's table: it could no
    longer accept a connection, open a window or a disk file."""
    pid = int(good.info()["service_pid"])
    opened = _footprint(pid)[0]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(service["service"]["socket"])
    channel = P.Channel(sock)
    read, write = os.pipe()
    try:
        body = msgspec.msgpack.encode(P.Info())
        frame = struct.pack(">I", len(body)) + body
        attached = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [read, write] * 2))]
        for _ in range(100):
            for piece in (frame[:1], frame[1:4], frame[4:]):  # a receive each: 4 descriptors with each
                sock.sendmsg([piece], attached)
            reply = channel.recv(P.REPLY, 10)
            assert reply.ok
        assert _footprint(pid)[0] <= opened + 1  # this connection's own socket
    finally:
        channel.close()
        os.close(read)
        os.close(write)
