"""The service's wire protocol: typed, versioned msgpack frames over a Unix socket.

Plain data only (msgspec Structs: bytes, ints, strings, lists, maps), never pickle,
so a connection can make the other side run nothing. Each frame is a 4-byte
big-endian length and a msgpack body of at most MAX_FRAME bytes, refused before
anything is buffered; once a frame has started, the rest must arrive within
FRAME_TIMEOUT_S. The hello reply carries the client's window as a file descriptor
(SCM_RIGHTS). Both ends check who is at the other end (SO_PEERCRED).

Requests (a tagged union) and what a Reply's value holds:
  Hello(version, config, chunk_bytes, namespace, dtype, shape)
                           -> {"slots": n, "window_bytes": n, "pages": kind} (+ the window's fd)
                              or None; where the client may map the DRAM tier, also
                              "tier_bytes", "tier_pages" (+ the tier's fd, sealed read-only)
  Residency(ranks, prefetch, await_s, lease_from, release, counters, unread)
                           -> [leading chunks every rank has, of those in DRAM, promotion pending];
                              with await_s, a request is held up to that long for the rest: the
                              cluster index is watched for them (kvstore/cluster/node.py); with
                              `lease_from`, also [lease, [[offset] per rank]]: the chunks from
                              that one on of the leading run every rank has in DRAM (those before
                              it the engine holds itself) pinned for the client's engine workers
                              to copy out of the tier (client_leases.py: a budget per user; lease
                              0: none), until Unpin(lease), a later Residency's `release` (its
                              load carried out: each chunk a get) or `unread` (none: no gets),
                              or the connection ends; `release`, `unread` and `counters` (as Count)
                              are taken first: one round trip per lookup
  Finished(ranks, answer_tokens, turn, idle_s)
                           -> None; a request's chunks (per rank) ended: its next turn is expected;
                              how it ended (answer length, turn, idle time before it; none of it
                              from an older client) feeds `learned` disk admission
  Expect(ranks, in_s)      -> None; a hint: these chunks are wanted in `in_s` seconds
  Count(counters)          -> None; adds to the service's counters
  Get(keys, slots)         -> [bool]: window slot slots[i] now holds chunk keys[i]
  Put(keys, slots, parent, namespace)
                           -> [bool]: chunk keys[i] (in window slot slots[i]) is stored, its
                              header naming `namespace` (None: the hello's)
  Pin(keys, verify)        -> [lease, [offset], [check]]: chunk keys[i]'s payload is at
                              offset[i] of the DRAM tier (-1: not in DRAM), pinned until
                              Unpin(lease) or the connection ends; at most a window's worth
                              at a time. Without `verify` (the service's own user only) a
                              disk hit's payload is not hashed by the service: check[i] is the
                              checksum the client must find as it copies it (None: verified)
  Unpin(leases, good, bad) -> None; of the leases' unverified chunks, those in `good` are
                              published in DRAM, those in `bad` dropped (counted), the others
                              released unpublished
  Info()                   -> the store's info
  Events(since)            -> [next cursor, events lost, [[stored?, key, medium], ...]]
                              (chunk_events.py; since < 0: the current cursor only)
  Announce(namespaces)     -> None; [digest, description] of namespaces the client stores
                              under (kvstore/service/namespaces.py)
  Namespaces(after, limit) -> one page of the announced namespaces, in digest order after
                              `after` (None: from the first), at most `limit` and about
                              PAGE_BYTES of descriptions; empty after the last (the service's
                              owner only)
  Purge(namespaces, dry_run)-> what was (or would be) removed of the records of these
                              namespace digests (the service's owner only)
  Shutdown()               -> None; the service drains, checkpoints and exits (its own
                              user only, not an allowed one)

Every field is bounded where it is decoded: keys are 16 bytes, key lists at most
MAX_KEYS long (a longer prompt is asked about in several frames: client.py), numbers
finite and in range, strings and maps short. A frame that breaks a bound, does not
decode, or nests deeper than the decoder goes (RecursionError) is a ProtocolError: the
end of that connection, counted by the service as `malformed.frame`, never of the service.
A reply's value is checked by the client against what it asked (`reply_as`): one of
another shape is a ProtocolError too.
"""

from __future__ import annotations

import array
import os
import socket
import struct
import time
from typing import Annotated, Any

import msgspec

from kvstore.format.errors import KVStoreError
from kvstore.tiers.return_rates import MAX_IDLE_S, MAX_TOKENS

PROTOCOL_VERSION = 15  # 6: a Put names its namespace, Announce/Namespaces/Purge; 7: Finished says how
# it ended; 8: Namespaces answers a page; 9: a Residency may await what it does not find; 10: a
# Residency leases, releases and counts; 11: a Pin's disk hits may be verified by the client;
# 12: a Residency leases from a chunk on (lease_from); 13: the DRAM tier is `dram` (its config
# key, lookups, info, events: a client of 12 would be refused as another config, not a version);
# 14: a Residency gives leases back unread (no get counted for them); 15: a Pin carries an Unpin
MAX_FRAME = 4 << 20
MAX_KEYS = 1 << 17  # keys in one frame's key lists together (2.3 MiB of msgpack)
MAX_RANKS = 1024  # key lists in one frame (tensor-parallel ranks x KV cache groups)
MAX_EXPECT_S = 86400.0  # how far ahead a hint may say its chunks are wanted
MAX_AWAIT_S = 3600.0  # the longest a Residency has the chunks it did not find awaited
MAX_ANNOUNCED = 1024  # namespaces in one announcement
MAX_FIELDS = 16  # fields of one namespace's description
MAX_TEXT = 512  # characters of one description field
MAX_PAGE = 1024  # namespaces in one page of a Namespaces reply
PAGE_BYTES = 1 << 20  # about as many bytes of descriptions as a page holds (one more at most)
FRAME_TIMEOUT_S = 30.0
_LENGTH = struct.Struct(">I")
_MAX_FDS = 4

Key = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
Keys = Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS)]
Ranks = Annotated[list[Keys], msgspec.Meta(max_length=MAX_RANKS)]
Whole = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
Amount = Annotated[float, msgspec.Meta(ge=0, le=1e15)]  # NaN and inf fail both bounds
Name = Annotated[str, msgspec.Meta(max_length=64)]
Tokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]  # an answer's tokens, a chain's turns
Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_IDLE_S)]  # NaN and inf fail both bounds


class ProtocolError(KVStoreError):
    """A peer sent something that is not a frame of this protocol."""


class Hello(msgspec.Struct, tag="hello", forbid_unknown_fields=True):
    version: int
    config: dict[Name, Any]  # compared with the service's (sessions.py), never acted on
    chunk_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 36)] | None = None
    namespace: Key = bytes(16)
    dtype: Name = "uint8"
    shape: Annotated[tuple[Whole, ...], msgspec.Meta(max_length=8)] = ()


class Residency(msgspec.Struct, tag="residency", forbid_unknown_fields=True):
    ranks: Ranks  # one prompt's keys per tensor-parallel rank
    prefetch: bool = False
    await_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_AWAIT_S)] = 0.0
    lease_from: Whole | None = None  # pin the DRAM run from this chunk on (for the client's workers)
    release: Annotated[list[Whole], msgspec.Meta(max_length=MAX_KEYS)] = []  # leases given back first
    counters: Annotated[dict[Name, Amount], msgspec.Meta(max_length=256)] = {}  # added first, as Count
    unread: Annotated[list[Whole], msgspec.Meta(max_length=MAX_KEYS)] = []  # given back, not read: no gets


class Finished(msgspec.Struct, tag="finished", forbid_unknown_fields=True):
    ranks: Ranks  # a finished request's stored chunks (prompt and answer), per rank
    answer_tokens: Tokens | None = None  # None: how it ended is not told
    turn: Tokens = 0  # times the chain it extends had been extended (connectors' ChainHistory)
    idle_s: Seconds | None = None  # how long that chain was idle before it; None: a new chain


class Expect(msgspec.Struct, tag="expect", forbid_unknown_fields=True):
    ranks: Ranks
    in_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_EXPECT_S)]


class Count(msgspec.Struct, tag="count", forbid_unknown_fields=True):
    counters: Annotated[dict[Name, Amount], msgspec.Meta(max_length=256)]


class Get(msgspec.Struct, tag="get", forbid_unknown_fields=True):
    keys: Keys
    slots: Annotated[list[Whole], msgspec.Meta(max_length=MAX_KEYS)]


class Put(msgspec.Struct, tag="put", forbid_unknown_fields=True):
    keys: Keys
    slots: Annotated[list[Whole], msgspec.Meta(max_length=MAX_KEYS)]
    parent: Key | None = None
    namespace: Key | None = None  # what the records' headers name (None: the hello's)


Description = Annotated[dict[Name, Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
                             | Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]],
                        msgspec.Meta(max_length=MAX_FIELDS)]


class Announce(msgspec.Struct, tag="announce", forbid_unknown_fields=True):
    namespaces: Annotated[list[tuple[Key, Description]], msgspec.Meta(max_length=MAX_ANNOUNCED)]


class Namespaces(msgspec.Struct, tag="namespaces", forbid_unknown_fields=True):
    after: Key | None = None  # the page starts after this digest (None: at the first)
    limit: Annotated[int, msgspec.Meta(ge=1, le=MAX_PAGE)] = MAX_PAGE


class Purge(msgspec.Struct, tag="purge", forbid_unknown_fields=True):
    namespaces: Keys
    dry_run: bool = True


class Unpin(msgspec.Struct, tag="unpin", forbid_unknown_fields=True):
    leases: Annotated[list[Whole], msgspec.Meta(max_length=MAX_KEYS)]
    good: Keys = []  # unverified chunks of these leases the client verified as it copied them
    bad: Keys = []  # and those whose payload it found another checksum for


class Pin(msgspec.Struct, tag="pin", forbid_unknown_fields=True):
    keys: Keys
    verify: bool = True  # False: the client verifies disk hits as it copies them (checks)
    unpin: Unpin | None = None  # done first: the waves the client has copied (no round trip of its own)


class Info(msgspec.Struct, tag="info", forbid_unknown_fields=True):
    pass


class Shutdown(msgspec.Struct, tag="shutdown", forbid_unknown_fields=True):
    pass


class Events(msgspec.Struct, tag="events", forbid_unknown_fields=True):
    since: int


Request = (Hello | Residency | Finished | Expect | Count | Get | Put | Info | Shutdown | Events | Pin | Unpin
           | Announce | Namespaces | Purge)


class Reply(msgspec.Struct, forbid_unknown_fields=True):
    ok: bool
    value: Any = None
    error: str = ""


_encoder = msgspec.msgpack.Encoder()
REQUEST = msgspec.msgpack.Decoder(Request)
REPLY = msgspec.msgpack.Decoder(Reply)


def reply_as(value: Any, kind: Any, what: str) -> Any:
    """A Reply's value as `kind` (a type msgspec checks: bounds, lengths, no bool for an int,
    no base64 text for bytes): a value that does not fit is a ProtocolError, never another
    exception in the caller, whatever the peer sent."""
    try:
        return msgspec.convert(value, kind, builtin_types=(bytes,))
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"{what} was answered with a malformed value: {exc}") from None


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                               struct.calcsize("3i")))


class Channel:
    """One connection: frames out and in, file descriptors with them. At most `keeps`
    descriptors received are kept for `take_fd` (a client's: a hello's window and tier);
    any other is closed as it arrives, so a peer that attaches descriptors to its frames
    cannot fill this process's table (the service takes none: `keeps` 0)."""

    def __init__(self, sock: socket.socket, keeps: int = _MAX_FDS) -> None:
        self.sock = sock
        self.keeps = keeps
        self.fds: list[int] = []  # descriptors received and not yet taken

    def send(self, message: msgspec.Struct, fds: tuple[int, ...] = ()) -> None:
        body = _encoder.encode(message)
        if len(body) > MAX_FRAME:
            raise ProtocolError(f"a {len(body)}-byte frame is over the {MAX_FRAME}-byte limit")
        frame = _LENGTH.pack(len(body)) + body
        self.sock.settimeout(FRAME_TIMEOUT_S)
        if fds:
            sent = self.sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                array.array("i", fds))])
            frame = frame[sent:]
        if frame:
            self.sock.sendall(frame)

    def recv(self, decoder: msgspec.msgpack.Decoder, timeout_s: float | None) -> Any:
        """The next frame, decoded; ProtocolError if it is not one; TimeoutError past the
        deadline (None: wait for a frame to start as long as it takes)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        first = self._read(1, deadline)
        deadline = deadline or time.monotonic() + FRAME_TIMEOUT_S  # once started, a frame is due
        (length,) = _LENGTH.unpack(first + self._read(_LENGTH.size - 1, deadline))
        if length > MAX_FRAME:
            raise ProtocolError(f"a {length}-byte frame is over the {MAX_FRAME}-byte limit")
        try:
            return decoder.decode(self._read(length, deadline))
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            raise ProtocolError(f"not a message of this protocol: {exc}") from None
        except RecursionError:
            raise ProtocolError("not a message of this protocol: nested too deeply") from None

    def take_fd(self) -> int | None:
        return self.fds.pop(0) if self.fds else None

    def _read(self, count: int, deadline: float | None) -> bytes:
        data = bytearray()
        while len(data) < count:
            self.sock.settimeout(None if deadline is None else max(0.0, deadline - time.monotonic()))
            try:
                chunk, ancillary, _, _ = self.sock.recvmsg(count - len(data),
                                                           socket.CMSG_SPACE(_MAX_FDS * 4))
            except BlockingIOError:  # the deadline had passed: a timeout of 0 reads only what is there
                raise TimeoutError("deadline passed") from None
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    received = array.array("i")
                    received.frombytes(payload[: len(payload) - len(payload) % 4])
                    for fd in received:
                        if len(self.fds) < self.keeps:
                            self.fds.append(fd)
                        else:
                            os.close(fd)
            if not chunk:
                raise EOFError("connection closed")
            data += chunk
        return bytes(data)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
        self.sock.close()
