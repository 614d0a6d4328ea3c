import dataclasses
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.format.keys import (
    KEY_BYTES,
    KeyExtras,
    KVNamespace,
    Placeholder,
    Shard,
    TensorParallel,
    Weights,
    chunk_keys,
)

NS = KVNamespace("m", "bfloat16", "NHD", 4)
tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=64)


@given(tokens_st, st.integers(0, 64))
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(tokens, cut):
    full = chunk_keys(tokens, NS)
    assert chunk_keys(tokens[:cut], NS) == full[: cut // NS.chunk_tokens]
    assert all(len(k) == KEY_BYTES for k in full)
    assert len(full) == len(tokens) // NS.chunk_tokens


@given(tokens_st.filter(lambda t: len(t) >= 8))
def test_continuing_a_chain_from_its_parent_gives_the_same_keys(tokens):
    full = chunk_keys(tokens, NS)
    assert chunk_keys(tokens[4:], NS, parent=full[0]) == full[1:]


def test_a_changed_token_changes_its_chunk_and_every_later_key():
    tokens = list(range(16))
    changed = tokens.copy()
    changed[5] += 1
    a, b = chunk_keys(tokens, NS), chunk_keys(changed, NS)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


@pytest.mark.parametrize("field,value", [("model", "other"), ("kv_dtype", "float16"),
                                         ("kv_layout", "HND"), ("shard", Shard(TensorParallel(1, 1))),
                                         ("shard", Shard(TensorParallel(0, 2))), ("salt", "lora-a"),
                                         ("shard", Shard(group="1:sliding_window:w256:L1:b128")),
                                         ("weights", Weights("xxh3:00")),
                                         ("weights", Weights(generation="a1")),
                                         ("weights", Weights("xxh3:00", "a1"))])
def test_every_namespace_field_separates_keys(field, value):
    other = dataclasses.replace(NS, **{field: value})
    assert chunk_keys(range(4), NS) != chunk_keys(range(4), other)


def test_keys_are_stable_across_processes_and_hash_seeds():
    code = ("from kvstore.format.keys import KVNamespace, chunk_keys;"
            "print(chunk_keys(range(8), KVNamespace('m','bfloat16','NHD',4))[1].hex())")
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout
               for seed in ("1", "2")}
    assert outputs == {chunk_keys(range(8), NS)[1].hex() + "\n"}


def test_numpy_and_list_tokens_agree_and_bad_ids_are_refused():
    assert chunk_keys(np.arange(8, dtype=np.int64), NS) == chunk_keys(list(range(8)), NS)
    with pytest.raises(ValueError, match="token ids"):
        chunk_keys([-1, 0, 0, 0], NS)


def test_a_namespace_without_a_group_keeps_the_digest_it_had_before_groups():
    """Chunks stored before hybrid models were supported are found again by one-group models
    (and so are chunks of a namespace that names no weights): key format 2's value."""
    assert NS.digest().hex() == "f2eb391e25cc5cb10371f4631af1ec3d"


def test_keys_are_sha256_of_the_documented_bytes():
    """Key format 2 as docs/architecture.md states it, computed here by hand: SHA-256 cut to
    16 bytes, of the canonical JSON for a namespace, and of (parent, namespace digest,
    tokens as <u4) for a chunk. A fast non-cryptographic hash in its place fails here."""
    text = json.dumps({"model": "m", "kv_dtype": "bfloat16", "kv_layout": "NHD", "chunk_tokens": 4,
                       "tp_rank": 0, "tp_world_size": 1, "salt": ""}, sort_keys=True, separators=(",", ":"))
    namespace = hashlib.sha256(text.encode()).digest()[:16]
    assert NS.digest() == namespace
    first = hashlib.sha256(bytes(16) + namespace + np.arange(4, dtype="<u4").tobytes()).digest()[:16]
    second = hashlib.sha256(first + namespace + np.arange(4, 8, dtype="<u4").tobytes()).digest()[:16]
    assert chunk_keys(range(8), NS) == [first, second]


def test_grouped_fields_keep_the_digest_of_the_flat_namespace():
    """tp rank and world size are one field now; the digest is still the flat JSON of before."""
    sharded = KVNamespace("m", "bfloat16", "NHD", 4, Shard(TensorParallel(1, 2)), salt="lora-a")
    assert sharded.digest().hex() == "8b4bc6225abbc9483145036f4a79cf4b"
    grouped = KVNamespace("m", "bfloat16", "NHD", 4,
                          Shard(TensorParallel(3, 4), "1:sliding_window:w256:L1:b128"))
    assert grouped.digest().hex() == "62ea5876bf09d8c7939aa9a6a85dea72"


def test_two_engines_that_updated_their_weights_differently_never_share_a_namespace():
    """Generations are random nonces, not counters: two engines one update past the same
    checkpoint name different namespaces (the connector draws them: secrets.token_hex)."""
    one, other = (KVNamespace("m", "bfloat16", "NHD", 4, weights=Weights("xxh3:00", nonce))
                  for nonce in ("9f2c", "41aa"))
    assert one.digest() != other.digest()
    assert one.fields()["weights"] == "xxh3:00" and one.fields()["generation"] == "9f2c"


# -- what the token ids do not show: images behind placeholders, prompt embeddings --------

TEXT_KEYS = ["f34a9180e13f425006a76dd4f40ed7aa", "e6adaf8b626fa13737dc6db20c3b6968",
             "ee4611d25c9646227f321186edad53f9"]  # chunk_keys(range(12), NS): key format 2
placeholder_st = st.builds(Placeholder, st.text(min_size=1, max_size=8), st.integers(0, 40),
                           st.integers(0, 12))


def test_text_only_keys_are_the_ones_stored_before_extras_existed():
    assert [k.hex() for k in chunk_keys(range(12), NS)] == TEXT_KEYS
    assert [k.hex() for k in chunk_keys(range(12), NS, extras=KeyExtras())] == TEXT_KEYS


@given(tokens_st, st.lists(placeholder_st, max_size=3))
def test_chunks_no_placeholder_touches_keep_their_text_keys(tokens, placeholders):
    """Extras change a chunk's key only from the first chunk they touch on (the chain
    carries them on); every chunk before it keeps the key it has without extras."""
    extras = KeyExtras(tuple(placeholders))
    plain, keyed = chunk_keys(tokens, NS), chunk_keys(tokens, NS, extras=extras)
    touched = [i for i in range(len(plain)) if extras.chunk(i, NS.chunk_tokens)]
    first = touched[0] if touched else len(plain)
    assert keyed[:first] == plain[:first]
    assert all(a != b for a, b in zip(keyed[first:], plain[first:], strict=True))


@given(st.lists(st.integers(0, 9), min_size=12, max_size=12), st.integers(0, 8), st.integers(1, 4),
       st.text(min_size=1, max_size=8), st.text(min_size=1, max_size=8))
def test_two_images_at_one_place_give_other_keys_from_the_image_on(tokens, offset, length, a, b):
    """The same text (the same placeholder tokens) with another image: every key from the
    image's first chunk on differs, the ones before do not."""
    keys_a = chunk_keys(tokens, NS, extras=KeyExtras((Placeholder(a, offset, length),)))
    keys_b = chunk_keys(tokens, NS, extras=KeyExtras((Placeholder(b, offset, length),)))
    first = offset // NS.chunk_tokens
    assert keys_a[:first] == keys_b[:first]
    assert (a == b) == (keys_a[first:] == keys_b[first:])
    if a != b:
        assert not set(keys_a[first:]) & set(keys_b[first:])


@given(st.integers(0, 7), st.integers(1, 4), st.integers(1, 3))
def test_the_same_image_at_another_offset_gives_other_keys(offset, length, shift):
    """Placeholder tokens look alike wherever they sit: the offset is what tells them apart,
    even when the image moves inside one chunk."""
    tokens = [0] * 16
    here = chunk_keys(tokens, NS, extras=KeyExtras((Placeholder("img", offset, length),)))
    there = chunk_keys(tokens, NS, extras=KeyExtras((Placeholder("img", offset + shift, length),)))
    first = offset // NS.chunk_tokens
    assert here[:first] == there[:first] and here[first:] != there[first:]
    assert all(x != y for x, y in zip(here[first:], there[first:], strict=True))


def test_an_image_spanning_chunks_is_in_each_of_them_with_its_offset_from_each():
    extras = KeyExtras((Placeholder("img", 2, 5),))
    assert [bool(extras.chunk(i, 4)) for i in range(3)] == [True, True, False]
    assert extras.chunk(0, 4) != extras.chunk(1, 4)  # offset +2 in the first, -2 in the second


@given(st.binary(min_size=1, max_size=16), st.binary(min_size=1, max_size=16))
def test_prompt_embeddings_digests_separate_keys(a, b):
    tokens = [0] * 8  # an embeddings prompt has no token ids: the engine's stand-ins
    keys_a = chunk_keys(tokens, NS, extras=KeyExtras(embeds=(a, a)))
    keys_b = chunk_keys(tokens, NS, extras=KeyExtras(embeds=(b, a)))
    assert (keys_a == keys_b) == (a == b)
    assert keys_a != chunk_keys(tokens, NS)


@given(st.lists(st.integers(0, 9), min_size=16, max_size=16), st.lists(placeholder_st, max_size=3),
       st.integers(1, 3))
def test_continuing_a_chain_with_extras_gives_the_same_keys(tokens, placeholders, cut):
    extras = KeyExtras(tuple(placeholders), embeds=(b"e0", b"", b"e2"))
    full = chunk_keys(tokens, NS, extras=extras)
    rest = chunk_keys(tokens[cut * 4 :], NS, parent=full[cut - 1], extras=extras, first=cut)
    assert rest == full[cut:]


@pytest.mark.parametrize("identifier,offset,length", [("", 0, 1), ("x", -1, 1), ("x", 0, -1),
                                                      ("x", True, 1), (None, 0, 1)])
def test_a_bad_placeholder_is_refused(identifier, offset, length):
    with pytest.raises(ValueError, match="placeholder"):
        Placeholder(identifier, offset, length)


def test_the_key_cost_benchmark_runs_against_key_format_1():
    """bench/lab/key_cost.py (the figures in docs/architecture.md): its baseline is the xxh3
    chain keys were before (the values pinned then), and it measures every figure it prints."""
    from bench.lab.key_cost import measure, xxh3_chain

    assert [k.hex() for k in xxh3_chain(np.arange(12), NS)] == [
        "4db2cb35d80490b6e53a2e9a767b7015", "705d0019c77f6792a5734efd90dcb3d9",
        "3fbe8e9b8e8ba63d85ace1e0971c81fa"]
    found = measure(16, [0.01])
    assert all(value > 0 for value in found.values()) and len(found) == 5
