"""The self-describing record: one 4096-byte header block, then the payload.

Byte layout of the header block (little-endian; offsets in bytes):

    0   4  magic  b"KVR1"
    4   2  format version (2: key format 2, kvstore/format/keys.py)
    6   2  header length in bytes (184)
    8   4  flags (0; reserved)
    12  4  reserved (0)
    16 16  key (the chunk key asked for must equal this)
    32 16  namespace digest
    48 16  parent key (the chunk before this one; zeros for chunk 0)
    64  8  sequence number (newer record of a key wins on recovery)
    72  8  payload length
    80  8  xxh3-64 of the payload
    88 16  dtype name, ASCII, NUL padded
   104  1  ndim
   105  7  padding
   112 64  shape, 8 x uint64
   176  8  xxh3-64 of bytes 0..175 (the header checksum)
   184 ... zero up to 4096

The payload starts at byte 4096 and is padded to a multiple of 4096, so every
record, its header and its payload are O_DIRECT-aligned. A record is served
only if the header checksum, the key and the payload checksum all verify.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from functools import cached_property

import xxhash

from kvstore.format.checksum import xxh3_64, xxh3_64_copy
from kvstore.format.errors import ShapeError

MAGIC = b"KVR1"
FORMAT_VERSION = 2  # 1: records of xxh3 keys (refused: never read as this format's)
BLOCK = 4096
HEADER_BLOCK = BLOCK
MAX_NDIM = 8
DTYPE_BYTES = 16
_BODY = struct.Struct("<4sHHII16s16s16sQQQ16sB7x8Q")  # everything the header checksum covers
_CHECKSUM = struct.Struct("<Q")
HEADER_LEN = _BODY.size + _CHECKSUM.size


def round_up(value: int, multiple: int = BLOCK) -> int:
    return -(-value // multiple) * multiple


def record_bytes(payload_capacity: int) -> int:
    """Bytes one record slot needs for payloads up to `payload_capacity`."""
    return HEADER_BLOCK + round_up(payload_capacity)


class HeaderState(enum.Enum):
    EMPTY = "empty"  # never written, or invalidated on purpose (all-zero magic)
    TORN = "torn"  # magic present, header checksum or fields do not verify
    VALID = "valid"


class MissReason(enum.Enum):
    """Why a present-looking chunk was not served; each is counted in stats."""

    BAD_HEADER = "bad_header"
    WRONG_KEY = "wrong_key"
    BAD_CHECKSUM = "bad_checksum"
    IO_ERROR = "io_error"
    TIMEOUT = "timeout"
    STALE = "stale"  # the right key, but not the copy (sequence number) an index entry named


@dataclass(frozen=True)
class TensorSpec:
    """What a payload holds: a tensor's dtype name (ASCII, at most DTYPE_BYTES) and shape
    (at most MAX_NDIM sizes). The header carries it so a record describes itself."""

    dtype: str = "uint8"
    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class RecordHeader:
    """One record's header as decoded. Grouping fields (`tensor`) changes no byte on
    disk: pack_header and parse_header write and read the flat layout above."""

    key: bytes
    namespace: bytes
    parent: bytes
    seq: int
    payload_len: int
    payload_checksum: int
    tensor: TensorSpec = TensorSpec()


KEY_OFFSET = 16
_PAYLOAD_LEN = struct.Struct("<Q")
_PAYLOAD_LEN_OFFSET = 72


def read_payload_len(block: memoryview) -> int:
    """The payload length field alone, for the DRAM fast path (trusted memory)."""
    return _PAYLOAD_LEN.unpack_from(block, _PAYLOAD_LEN_OFFSET)[0]


def payload_checksum(payload: memoryview | bytes) -> int:
    return xxh3_64(payload)


@dataclass(frozen=True)
class RecordEncoder:
    """What every record of one store shares (dtype, shape, and the namespace of a record
    put without one), checked once, when the store is made, so a bad value is an error
    before any slot is taken."""

    namespace: bytes = bytes(16)
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, bytes) or len(self.namespace) != 16:
            raise ShapeError(f"namespace must be 16 bytes, got {self.namespace!r}")
        if not isinstance(self.dtype, str) or not self.dtype.isascii() or not self.dtype:
            raise ShapeError(f"dtype name must be non-empty ASCII, got {self.dtype!r}")
        if len(self.dtype) > DTYPE_BYTES:
            raise ShapeError(f"dtype name {self.dtype!r} is {len(self.dtype)} bytes; a record "
                             f"header holds {DTYPE_BYTES} (drop a module prefix such as 'torch.')")
        if len(self.shape) > MAX_NDIM or any(not isinstance(d, int) or d < 0 for d in self.shape):
            raise ShapeError(f"shape must be at most {MAX_NDIM} sizes >= 0, got {self.shape!r}")

    @cached_property
    def tensor(self) -> TensorSpec:
        return TensorSpec(self.dtype, self.shape)

    def header(self, key: bytes, parent: bytes | None, seq: int,
               payload: memoryview | bytes, namespace: bytes | None = None,
               checksum: int | None = None) -> RecordHeader:
        """The record's header; `namespace` is the chunk's own (None: the store's); `checksum`
        the payload's, where the caller took it already (None: taken here)."""
        return RecordHeader(key=key, namespace=namespace or self.namespace, parent=parent or bytes(16),
                            seq=seq, payload_len=len(payload),
                            payload_checksum=payload_checksum(payload) if checksum is None else checksum,
                            tensor=self.tensor)

    def write(self, image: memoryview, key: bytes, parent: bytes | None, seq: int,
              payload: memoryview, namespace: bytes | None = None) -> RecordHeader:
        """The whole record written into `image` (a slot or a staging buffer): the header it
        held zeroed first (`invalidate_header`), the payload copied and hashed in one pass
        over memory (xxh3_64_copy), then its header."""
        invalidate_header(image)
        checksum = xxh3_64_copy(image[HEADER_BLOCK : HEADER_BLOCK + len(payload)], payload)
        header = self.header(key, parent, seq, payload, namespace, checksum)
        pack_header(header, image)
        return header


def pack_header(header: RecordHeader, block: memoryview) -> None:
    """Write `header` into the first HEADER_BLOCK bytes of `block`, zeroing the rest."""
    tensor = header.tensor
    if len(tensor.shape) > MAX_NDIM:
        raise ValueError(f"at most {MAX_NDIM} dimensions, got shape {tensor.shape}")
    dtype = tensor.dtype.encode("ascii")
    if len(dtype) > DTYPE_BYTES:
        raise ValueError(f"dtype name too long: {tensor.dtype!r}")
    shape = tuple(tensor.shape) + (0,) * (MAX_NDIM - len(tensor.shape))
    fields = (
        MAGIC, FORMAT_VERSION, HEADER_LEN, 0, 0,
        header.key, header.namespace, header.parent, header.seq, header.payload_len,
        header.payload_checksum, dtype, len(tensor.shape), *shape,
    )
    body = _BODY.pack(*fields)
    block[: _BODY.size] = body
    block[_BODY.size : HEADER_LEN] = _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))
    block[HEADER_LEN:HEADER_BLOCK] = bytes(HEADER_BLOCK - HEADER_LEN)


def invalidate_header(block: memoryview) -> None:
    """Zero a header block: the slot then reads back as EMPTY. Done before anything of a
    new record is written into a DRAM slot: a reader that copies a payload out of the
    shared tier whose pin may have gone with another connection (a scheduler's lease)
    checks the key before and after its copy, and the old key would stay until the new
    header, so a payload rewritten under the copy would pass both checks (x86 keeps
    stores in order)."""
    block[:HEADER_BLOCK] = bytes(HEADER_BLOCK)


def parse_header(block: memoryview | bytes) -> tuple[HeaderState, RecordHeader | None]:
    """Decode and verify a header block; never raises on garbage."""
    raw = bytes(block[:HEADER_LEN])
    if raw[:4] != MAGIC:
        return (HeaderState.EMPTY if raw[:4] == b"\0\0\0\0" else HeaderState.TORN), None
    fields = _BODY.unpack(raw[: _BODY.size])
    (_, version, length, _, _, key, namespace, parent, seq, payload_len, checksum, dtype,
     ndim) = fields[:13]
    shape = fields[13:]
    (stored_sum,) = _CHECKSUM.unpack(raw[_BODY.size :])
    if (
        xxhash.xxh3_64_intdigest(raw[: _BODY.size]) != stored_sum
        or version != FORMAT_VERSION
        or length != HEADER_LEN
        or ndim > MAX_NDIM
    ):
        return HeaderState.TORN, None
    header = RecordHeader(
        key=key,
        namespace=namespace,
        parent=parent,
        seq=seq,
        payload_len=payload_len,
        payload_checksum=checksum,
        tensor=TensorSpec(dtype.rstrip(b"\0").decode("ascii", "replace"), tuple(shape[:ndim])),
    )
    return HeaderState.VALID, header


def check_record(
    block: memoryview | bytes, payload: memoryview | bytes, expected_key: bytes | None,
    copy_to: memoryview | None = None, check_payload: bool = True,
) -> tuple[RecordHeader | None, MissReason | None]:
    """Verify a header block and its payload against the key asked for. `copy_to`: the
    payload is also copied there, in the same pass over memory as its checksum (the
    copy's bytes count only where this returns no miss reason). Without `check_payload`
    only the header, key and length are: the payload's checksum is left to whoever copies
    it out (header.payload_checksum says what it must be)."""
    _, header = parse_header(block)
    if header is None:
        return None, MissReason.BAD_HEADER
    if expected_key is not None and header.key != expected_key:
        return header, MissReason.WRONG_KEY
    if header.payload_len > len(payload):
        return header, MissReason.BAD_HEADER
    if not check_payload:
        return header, None
    body = payload[: header.payload_len]
    if copy_to is not None and len(copy_to) == header.payload_len and isinstance(body, memoryview):
        checksum = xxh3_64_copy(copy_to, body)
    else:
        checksum = payload_checksum(body)
        if copy_to is not None:
            copy_to[: header.payload_len] = body
    if checksum != header.payload_checksum:
        return header, MissReason.BAD_CHECKSUM
    return header, None
