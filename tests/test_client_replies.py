"""Replies the client gets, fuzzed (hypothesis): whatever a service sends back (a buggy one,
a corrupted frame, an impostor), every StoreClient request either returns a value of the
shape its docstring promises or raises KVStoreError (ServiceUnavailable included), never
another exception and never a hang. The service end is the other end of a socket pair,
on a thread: it reads each request frame and answers with the next generated answer (a
Reply whose value is any msgpack, an error, raw garbage, a truncated or oversize frame),
then hangs up. The hello with a chunk size is fuzzed too, with descriptors passed as the
service passes its window and tier, and no descriptor may be left open after a refused one.
(The service's side of the same boundary, requests fuzzed: test_never_down.py.)"""

from __future__ import annotations

import array
import contextlib
import math
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.config.store import StoreConfig, load_config
from kvstore.format.errors import KVStoreError
from kvstore.service import client as client_module
from kvstore.service import protocol as P
from kvstore.service.client import Found, StoreClient
from kvstore.tiers.return_rates import RequestEnd

TIMEOUT_S = 2.0  # a request's deadline: every answer comes or the service end hangs up at once
CHUNK_BYTES = 4096
EXAMPLES = settings(max_examples=200)


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> StoreConfig:
    """A config whose socket nothing listens at (the client is handed its channel)."""
    folder = tmp_path_factory.mktemp("replies")
    return load_config({"tiers": {"dram": {"capacity": "4MiB"}},
                        "service": {"socket": str(folder / "kvstore.sock"), "spawn": False}})


# -- what a service end may send ---------------------------------------------------------

SCALARS = (st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.integers(-3, 20)
           | st.floats() | st.text(max_size=6) | st.binary(max_size=20) | st.binary(min_size=16, max_size=16)
           | st.sampled_from([math.inf, math.nan, -1, 0, 1, (1 << 64) - 1, 1 << 40, "kvstore-dram"])
           | st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=12)))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=6)
                      | st.dictionaries(st.text(max_size=8) | st.integers(-2, 2), inner, max_size=4),
                      max_leaves=24)
NUMBERS = st.integers(-2, 8) | st.sampled_from([(1 << 64) - 1, 1 << 40, -(1 << 63), True, 1.0, math.nan,
                                                 None, "1"])


def _near(length: int) -> st.SearchStrategy[list[Any]]:
    """Lists close to `length` long of numbers that are almost right."""
    return st.lists(NUMBERS | st.none(), min_size=max(0, length - 2), max_size=length + 2)


def _shaped(keys: int) -> st.SearchStrategy[Any]:
    """Values shaped like some request's answer for `keys` keys, each part perhaps wrong."""
    flags = st.lists(st.booleans() | NUMBERS, min_size=max(0, keys - 1), max_size=keys + 1)
    residency = st.tuples(NUMBERS, NUMBERS, st.booleans() | NUMBERS).map(list)
    leased = st.tuples(NUMBERS, NUMBERS, st.booleans(), NUMBERS,
                       st.lists(_near(keys), max_size=3)).map(list)
    pin = st.tuples(NUMBERS, _near(keys), _near(keys)).map(list)
    event = st.tuples(st.booleans() | NUMBERS, st.binary(min_size=15, max_size=17) | st.text(max_size=3)
                      | NUMBERS, st.text(max_size=70) | NUMBERS).map(list)
    events = st.tuples(NUMBERS, NUMBERS, st.lists(event, max_size=3)).map(list)
    mapping = st.dictionaries(st.text(max_size=8), NUMBERS | st.text(max_size=4), max_size=4)
    page = st.lists(mapping | NUMBERS, max_size=4)
    return flags | residency | leased | pin | events | mapping | page


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _answers(keys: int = 0) -> st.SearchStrategy[bytes]:
    """The bytes a service end sends for one request."""
    value = VALUES | _shaped(keys)
    good = value.map(lambda v: _frame(msgspec.msgpack.encode(P.Reply(True, v))))
    refused = st.text(max_size=40).map(lambda e: _frame(msgspec.msgpack.encode(P.Reply(False, None, e))))
    odd = st.fixed_dictionaries({"ok": VALUES}, optional={"value": VALUES, "error": VALUES,
                                                           "extra": VALUES})
    odd_reply = odd.map(lambda d: _frame(msgspec.msgpack.encode(d)))
    garbage = st.binary(max_size=40).map(_frame)
    truncated = st.tuples(st.integers(1, 1 << 12), st.binary(max_size=8)).map(
        lambda t: struct.pack(">I", t[0] + len(t[1])) + t[1])
    oversize = st.integers(P.MAX_FRAME + 1, (1 << 32) - 1).map(lambda n: struct.pack(">I", n))
    short = st.binary(min_size=1, max_size=3)  # not even a length
    deep = st.integers(100, 5000).map(lambda n: _frame(b"\x83\xa2ok\xc3\xa5value\x91" + b"\x91" * n + b"\xc0"
                                                        + b"\xa5error\xa0"))
    return (good | good | good | refused | odd_reply | garbage | truncated | oversize | short | deep)


# -- the service end ---------------------------------------------------------------------


class ServiceEnd:
    """The service's end of a socket pair, on a thread: reads each request, answers it
    with the next of `answers` (descriptors with it where `fds` says), then hangs up."""

    def __init__(self, sock: socket.socket, answers: Sequence[bytes],
                 fds: Sequence[Sequence[int]] = ()) -> None:
        self.requests: list[Any] = []
        self._channel = P.Channel(sock)
        self._answers = list(answers)
        self._fds = list(fds)
        self._thread = threading.Thread(target=self._serve, daemon=True, name="fake-service")
        self._thread.start()

    def _serve(self) -> None:
        sock = self._channel.sock
        try:
            for n, answer in enumerate(self._answers):
                self.requests.append(self._channel.recv(P.REQUEST, TIMEOUT_S))
                fds = self._fds[n] if n < len(self._fds) else ()
                if fds:
                    sock.sendmsg([answer], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                else:
                    sock.sendall(answer)
        except (OSError, EOFError, P.ProtocolError):
            pass  # the client hung up first
        finally:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            self._channel.close()

    def join(self) -> None:
        self._thread.join(TIMEOUT_S * 4)
        assert not self._thread.is_alive(), "the service end is still waiting"


HELLO = _frame(msgspec.msgpack.encode(P.Reply(True, None)))


@contextlib.contextmanager
def talking(config: StoreConfig, answers: Sequence[bytes]) -> Iterator[tuple[StoreClient, ServiceEnd]]:
    """A lookup client (no chunk size) whose hello is answered well, then `answers`."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    end = ServiceEnd(theirs, [HELLO, *answers])
    try:
        with mock.patch.object(client_module, "connect", lambda _: P.Channel(ours)):
            client = StoreClient(config, timeout_s=TIMEOUT_S)
    except BaseException:
        ours.close()
        raise
    try:
        yield client, end
    finally:
        client.close()
        end.join()


def _answered(config: StoreConfig, answers: Sequence[bytes], call: Callable[[StoreClient], Any]) -> Any:
    """`call`'s result, or the KVStoreError it raised; any other exception fails the test."""
    with talking(config, answers) as (client, _):
        try:
            return call(client)
        except KVStoreError as exc:
            return exc


# -- what each request may return --------------------------------------------------------

KEYS = st.lists(st.binary(min_size=16, max_size=16), max_size=5)
RANKS = st.lists(KEYS, max_size=3)


def _is_int(value: Any, low: int = -(1 << 63), high: int = (1 << 64) - 1) -> bool:
    return type(value) is int and low <= value <= high


def _flags(result: Any, keys: Sequence[bytes]) -> bool:
    return isinstance(result, list) and len(result) == len(keys) and all(type(ok) is bool for ok in result)


def _found(result: Found, ranks: Sequence[Sequence[bytes]], lease_from: int | None) -> None:
    """A Found as lookup promises it: leading chunks at most the shortest rank's, of those
    in DRAM at most all, and the lease's offsets one tuple per rank, -1 before `lease_from`,
    none past the DRAM run."""
    assert isinstance(result, Found)
    most = min((len(k) for k in ranks), default=0)
    assert _is_int(result.stored, 0, most) and _is_int(result.resident, 0, result.stored), result
    assert type(result.pending) is bool and _is_int(result.lease, 0), result
    assert isinstance(result.offsets, tuple) and len(result.offsets) in (0, len(ranks)), result
    for offsets in result.offsets:
        assert isinstance(offsets, tuple) and len(offsets) <= result.resident, result
        assert all(_is_int(o, -1) for o in offsets), result
        assert all(o == -1 for o in offsets[: lease_from or 0]), result


@given(answer=st.data(), ranks=RANKS, lease_from=st.none() | st.integers(0, 4), prefetch=st.booleans())
@EXAMPLES
def test_a_lookup_returns_what_it_promises_or_a_kvstore_error(config, answer, ranks, lease_from, prefetch):
    keys = max((len(k) for k in ranks), default=0)
    result = _answered(config, [answer.draw(_answers(keys))],
                       lambda c: c.lookup(ranks, prefetch, lease_from, release=[3], counters={"x": 1.0}))
    if not isinstance(result, KVStoreError):
        _found(result, ranks, lease_from)


@given(answers=st.lists(_answers(2), min_size=1, max_size=4), ranks=st.lists(
    st.lists(st.binary(min_size=16, max_size=16), min_size=3, max_size=7), min_size=1, max_size=2))
@EXAMPLES
def test_a_lookup_in_pieces_returns_what_it_promises_or_a_kvstore_error(config, answers, ranks):
    """A prompt longer than a frame carries, asked about a piece at a time (MAX_KEYS made small)."""
    with mock.patch.object(P, "MAX_KEYS", 2 * len(ranks)):
        result = _answered(config, answers, lambda c: c.lookup(ranks, lease_from=1))
    if not isinstance(result, KVStoreError):
        _found(result, ranks, 1)


@given(answer=st.data(), keys=KEYS, prefetch=st.booleans())
@EXAMPLES
def test_residency_returns_a_leading_run_or_a_kvstore_error(config, answer, keys, prefetch):
    result = _answered(config, [answer.draw(_answers(len(keys)))], lambda c: c.residency(keys, prefetch))
    if not isinstance(result, KVStoreError):
        stored, resident, pending = result
        assert _is_int(stored, 0, len(keys)) and _is_int(resident, 0, stored), result
        assert type(pending) is bool, result


@given(answer=st.data(), ranks=RANKS)
@EXAMPLES
def test_residency_ranks_returns_a_leading_run_or_a_kvstore_error(config, answer, ranks):
    result = _answered(config, [answer.draw(_answers(3))], lambda c: c.residency_ranks(ranks, await_s=0.5))
    if not isinstance(result, KVStoreError):
        stored, resident, pending = result
        most = min((len(k) for k in ranks), default=0)
        assert _is_int(stored, 0, most) and _is_int(resident, 0, stored) and type(pending) is bool, result


@given(answer=st.data(), keys=KEYS, put=st.booleans())
@EXAMPLES
def test_a_get_or_put_returns_one_bool_per_key_or_a_kvstore_error(config, answer, keys, put):
    slots = list(range(len(keys)))
    call: Callable[[StoreClient], Any] = ((lambda c: c.put(keys, slots, None, bytes(16))) if put
                                          else (lambda c: c.get(keys, slots)))
    result = _answered(config, [answer.draw(_answers(len(keys)))], call)
    if not isinstance(result, KVStoreError):
        assert _flags(result, keys), result


@given(answer=st.data(), keys=KEYS, verify=st.booleans(), release=st.lists(st.integers(1, 9), max_size=2))
@EXAMPLES
def test_a_pin_returns_an_offset_per_key_or_a_kvstore_error(config, answer, keys, verify, release):
    result = _answered(config, [answer.draw(_answers(len(keys)))],
                       lambda c: c.pin(keys, verify, release, keys[:1], ()))
    if not isinstance(result, KVStoreError):
        lease, offsets, checks = result
        assert _is_int(lease, 0), result
        assert isinstance(offsets, list) and len(offsets) == len(keys), result
        assert all(_is_int(o, -1) for o in offsets), result
        assert isinstance(checks, list) and len(checks) <= len(keys), result
        assert all(c is None or _is_int(c, 0) for c in checks), result


@given(answer=st.data(), since=st.integers(-1, 1 << 20))
@EXAMPLES
def test_events_return_a_cursor_and_keyed_events_or_a_kvstore_error(config, answer, since):
    result = _answered(config, [answer.draw(_answers(3))], lambda c: c.events(since))
    if not isinstance(result, KVStoreError):
        cursor, lost, events = result
        assert _is_int(cursor, 0) and _is_int(lost, 0) and isinstance(events, list), result
        for stored, key, medium in events:
            assert type(stored) is bool and type(key) is bytes and len(key) == 16, result
            assert type(medium) is str, result


@given(answer=st.data(), kind=st.sampled_from(["info", "namespaces", "purge"]))
@EXAMPLES
def test_info_namespaces_and_purge_return_their_maps_or_a_kvstore_error(config, answer, kind):
    calls: dict[str, Callable[[StoreClient], Any]] = {
        "info": lambda c: c.info(), "namespaces": lambda c: c.namespaces(None, 3),
        "purge": lambda c: c.purge([bytes(16)], dry_run=True)}
    result = _answered(config, [answer.draw(_answers(3))], calls[kind])
    if isinstance(result, KVStoreError):
        return
    if kind == "info":
        assert isinstance(result, dict) and all(type(k) is str for k in result), result
    elif kind == "namespaces":
        assert isinstance(result, list) and len(result) <= 3, result
        assert all(isinstance(d, dict) and all(type(k) is str for k in d) for d in result), result
    else:
        assert isinstance(result, dict) and all(type(k) is str and _is_int(v) for k, v in result.items())


NOTES: dict[str, Callable[[StoreClient], Any]] = {
    "finished": lambda c: c.finished([[bytes(16)]]),
    "finished_end": lambda c: c.finished([[bytes(16)]], RequestEnd(5, 1, 2.0)),
    "expect": lambda c: c.expect([[bytes(16)]], 3.0),
    "count": lambda c: c.count({"save.x": 1.0}),
    "unpin": lambda c: c.unpin([1, 2], [bytes(16)], []),
    "announce": lambda c: c.announce([(bytes(16), {"model": "m", "tokens": 16})]),
    "shutdown": lambda c: c.shutdown(timeout_s=0.1),  # nothing at the socket's path: gone at once
}


@given(answer=st.data(), kind=st.sampled_from(sorted(NOTES)))
@EXAMPLES
def test_requests_answered_by_nothing_return_none_or_a_kvstore_error(config, answer, kind):
    result = _answered(config, [answer.draw(_answers(1))], NOTES[kind])
    assert result is None or isinstance(result, KVStoreError), result


# -- the hello, with the descriptors it passes ---------------------------------------------


def _memfd(size: int) -> int:
    fd = os.memfd_create("replies", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


SIZES = st.sampled_from([CHUNK_BYTES, 1 << 16, 1 << 17])
GOOD_HELLO = st.fixed_dictionaries(  # right but for what the descriptors turn out to be
    {"slots": st.integers(1, 16), "window_bytes": SIZES, "pages": st.sampled_from(["4k", "thp"])},
    optional={"tier_bytes": SIZES, "tier_pages": st.sampled_from(["4k", "thp"])})
ODD_HELLO = st.fixed_dictionaries(
    {}, optional={"slots": NUMBERS | st.integers(0, 64), "window_bytes": NUMBERS | st.integers(0, 1 << 18),
                  "pages": st.sampled_from(["4k", "thp", "hugetlb"]) | VALUES,
                  "tier_bytes": NUMBERS | st.integers(0, 1 << 18),
                  "tier_pages": st.sampled_from(["4k", "thp"]) | VALUES}) | VALUES
FD_KINDS = st.lists(st.sampled_from(["memfd", "small", "pipe", "read-only"]), max_size=3)


@given(value=st.sampled_from([GOOD_HELLO, ODD_HELLO, VALUES]).flatmap(lambda kind: kind), fd_kinds=FD_KINDS,
       map_tier=st.booleans(), answer=st.data())
@EXAMPLES
def test_a_hello_maps_what_it_was_sent_or_raises_a_kvstore_error_and_leaks_nothing(
        config, value, fd_kinds, map_tier, answer):
    """A data client's hello: a window whose slots all fit it (and a tier where one came),
    or a KVStoreError with every descriptor the reply brought closed."""
    before = _open_fds()
    fds: list[int] = []
    for kind in fd_kinds:
        if kind == "pipe":
            read, write = os.pipe()
            os.close(write)
            fds.append(read)
        elif kind == "read-only":  # big enough, but a window cannot be mapped writable from it
            memfd = _memfd(1 << 17)
            fds.append(os.open(f"/proc/self/fd/{memfd}", os.O_RDONLY))
            os.close(memfd)
        else:
            fds.append(_memfd(1 << 16 if kind == "memfd" else 100))
    framed = answer.draw(st.integers(0, 4))  # mostly `value`, else any other answer
    reply = answer.draw(_answers()) if framed == 0 else _frame(msgspec.msgpack.encode(P.Reply(True, value)))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    end = ServiceEnd(theirs, [reply], [fds])
    client = None
    try:
        with mock.patch.object(client_module, "connect", lambda _: P.Channel(ours)):
            client = StoreClient(config, CHUNK_BYTES, timeout_s=TIMEOUT_S, map_tier=map_tier)
    except KVStoreError:
        pass
    finally:
        end.join()
        for fd in fds:
            os.close(fd)
    if client is not None:
        memory = client.memory
        assert memory.window is not None and memory.slots >= 1, value
        assert memory.slots * CHUNK_BYTES <= memory.window.nbytes, value
        assert all(len(memory.slot(n)) == CHUNK_BYTES for n in range(memory.slots)), value
        client.close()
    else:
        ours.close()
    assert _open_fds() == before, value
