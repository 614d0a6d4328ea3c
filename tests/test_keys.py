import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.format.keys import KEY_BYTES, KVNamespace, TensorParallel, chunk_keys

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
                                         ("kv_layout", "HND"), ("tp", TensorParallel(1, 1)),
                                         ("tp", TensorParallel(0, 2)), ("salt", "lora-a"),
                                         ("group", "1:sliding_window:w256:L1:b128")])
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
    """Chunks stored before hybrid models were supported are found again by one-group models."""
    assert NS.digest().hex() == "940357a323f94fd80f6995a3a9389979"


def test_grouped_fields_keep_the_digest_of_the_flat_namespace():
    """tp rank and world size are one field now; the digest is still the flat JSON of before."""
    sharded = KVNamespace("m", "bfloat16", "NHD", 4, TensorParallel(1, 2), salt="lora-a")
    assert sharded.digest().hex() == "d108c1e32436d696b917a2174ae9b6c6"
    grouped = KVNamespace("m", "bfloat16", "NHD", 4, TensorParallel(3, 4),
                          group="1:sliding_window:w256:L1:b128")
    assert grouped.digest().hex() == "0cb0c03a052998e55441ee0ddc719229"
