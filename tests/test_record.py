import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.format.record import (
    HEADER_BLOCK,
    HEADER_LEN,
    KEY_OFFSET,
    HeaderState,
    MissReason,
    RecordEncoder,
    RecordHeader,
    TensorSpec,
    check_record,
    invalidate_header,
    pack_header,
    parse_header,
    payload_checksum,
)

key_st = st.binary(min_size=16, max_size=16)


def _record(payload: bytes, key: bytes = b"k" * 16) -> bytearray:
    block = bytearray(HEADER_BLOCK)
    header = RecordHeader(key, b"n" * 16, b"p" * 16, 7, len(payload), payload_checksum(payload),
                          TensorSpec("bfloat16", (2, len(payload) // 2)))
    pack_header(header, memoryview(block))
    return block


@given(key_st, key_st, key_st, st.integers(0, 2**64 - 1), st.binary(max_size=512),
       st.lists(st.integers(0, 2**40), max_size=8))
def test_header_round_trip(key, namespace, parent, seq, payload, shape):
    header = RecordHeader(key, namespace, parent, seq, len(payload), payload_checksum(payload),
                          TensorSpec("float16", tuple(shape)))
    block = bytearray(HEADER_BLOCK)
    pack_header(header, memoryview(block))
    assert parse_header(block) == (HeaderState.VALID, header)
    assert check_record(block, payload, key) == (header, None)


@given(st.integers(0, HEADER_LEN - 1), st.integers(1, 255))
def test_any_corrupted_header_byte_is_never_valid(position, flip):
    block = _record(b"x" * 64)
    block[position] ^= flip
    state, header = parse_header(block)
    assert state is not HeaderState.VALID and header is None


@given(st.binary(min_size=1, max_size=256), st.data())
def test_a_corrupted_payload_is_a_checksum_miss(payload, data):
    block = _record(payload)
    position = data.draw(st.integers(0, len(payload) - 1))
    bad = bytearray(payload)
    bad[position] ^= 0x5A
    assert check_record(block, bytes(bad), b"k" * 16)[1] is MissReason.BAD_CHECKSUM


def test_wrong_key_and_empty_and_invalidated():
    block = _record(b"abc")
    assert check_record(block, b"abc", b"q" * 16)[1] is MissReason.WRONG_KEY
    assert parse_header(bytes(HEADER_BLOCK))[0] is HeaderState.EMPTY
    invalidate_header(memoryview(block))
    assert parse_header(block)[0] is HeaderState.EMPTY


def test_header_refuses_what_it_cannot_encode():
    with pytest.raises(ValueError, match="dimensions"):
        pack_header(RecordHeader(b"k" * 16, b"n" * 16, b"p" * 16, 0, 0, 0, TensorSpec("u8", (1,) * 9)),
                    memoryview(bytearray(HEADER_BLOCK)))


def test_a_checksum_fused_with_a_copy_equals_the_hash_and_the_copy_apart():
    import numpy as np
    import xxhash

    from kvstore.format.checksum import PIECE, xxh3_64_copy

    # Lengths: under the fused path's least, at it, between it and a piece (no multiple of
    # 64), whole pieces (a chunk's usual length) and a tail; sources at odd addresses too.
    for size in (100, 1 << 16, 100_003, 4 * PIECE, 3 * PIECE + 17):
        for offset in (0, 13):
            source = np.random.default_rng(size).integers(0, 256, size + offset, dtype=np.uint8)[offset:]
            target = np.zeros(size, np.uint8)
            assert xxh3_64_copy(memoryview(target), memoryview(source)) == xxhash.xxh3_64_intdigest(source)
            assert np.array_equal(target, source)
    with pytest.raises(ValueError, match="copy of 4 bytes into 3"):
        xxh3_64_copy(memoryview(bytearray(3)), memoryview(bytearray(4)))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([100, 1 << 16, 3 * (256 << 10) + 17]), st.data())
def test_a_checksum_fused_with_a_scatter_equals_the_hash_and_the_copies_apart(size, data):
    """xxh3_64_scatter: pieces anywhere in the payload (some overlapping, some bytes in
    none, a read-only payload), each copied where it goes, the digest the whole payload's."""
    import numpy as np
    import xxhash

    from kvstore.format.checksum import xxh3_64_scatter

    source = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    spans = data.draw(st.lists(st.tuples(st.integers(0, size - 1), st.integers(0, size)), max_size=12))
    targets = [(np.zeros(min(length, size - at), np.uint8), at) for at, length in spans]
    payload = memoryview(source.tobytes())  # read-only
    digest = xxh3_64_scatter(payload, [(memoryview(target), at) for target, at in targets])
    assert digest == xxhash.xxh3_64_intdigest(source)
    for target, at in targets:
        assert np.array_equal(target, source[at : at + len(target)])
    with pytest.raises(ValueError, match="outside"):
        xxh3_64_scatter(payload, [(memoryview(bytearray(4)), size - 2)])


def test_a_record_checked_on_its_way_to_the_caller_still_misses_on_a_bad_checksum():
    payload = bytearray(range(256)) * 1024
    block = _record(bytes(payload))
    out = bytearray(len(payload))
    assert check_record(block, memoryview(payload), b"k" * 16, memoryview(out))[1] is None
    assert out == payload
    payload[5000] ^= 1
    assert check_record(block, memoryview(payload), b"k" * 16, memoryview(out))[1] is MissReason.BAD_CHECKSUM


def test_a_record_written_over_another_unnames_it_before_any_byte_of_its_payload(monkeypatch):
    """A slot's old key stays until the new header: a reader that checks the key before and
    after copying a payload out (one whose pin went with another connection) would take a
    payload rewritten under its copy for the old key's. The key goes first."""
    from kvstore.format import record

    image = memoryview(bytearray(HEADER_BLOCK + 4096))
    encoder = RecordEncoder()
    encoder.write(image, b"o" * 16, None, 1, memoryview(b"\x01" * 4096))
    named_during_copy = []
    copy = record.xxh3_64_copy

    def watched(dst, src):
        named_during_copy.append(bytes(image[KEY_OFFSET : KEY_OFFSET + 16]))
        return copy(dst, src)

    monkeypatch.setattr(record, "xxh3_64_copy", watched)
    encoder.write(image, b"n" * 16, None, 2, memoryview(b"\x02" * 4096))
    assert named_during_copy == [bytes(16)]  # neither the old key nor the new one yet
    assert bytes(image[KEY_OFFSET : KEY_OFFSET + 16]) == b"n" * 16
