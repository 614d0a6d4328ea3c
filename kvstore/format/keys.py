"""Content-addressed chunk keys.

A prompt is cut into chunks of `chunk_tokens` tokens. Chunk i's key is a 128-bit
xxh3 digest over (key of chunk i-1, namespace digest, chunk i's token ids as
little-endian uint32). Chaining makes a key stand for the whole prefix up to and
including its chunk, which is what KV depends on; the namespace digest keeps KV of
different models, dtypes, layouts or tensor-parallel shards apart. Only stable
byte encodings go in, so keys agree across processes, hosts and restarts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

KEY_BYTES = 16
ROOT_KEY = bytes(KEY_BYTES)  # the "previous key" of chunk 0
_MAX_TOKEN_ID = (1 << 32) - 1


@dataclass(frozen=True)
class TensorParallel:
    """Which shard of a tensor-parallel model's KV heads a rank holds: `rank` of
    `world_size` (each rank's KV is its own, so each has its own keys)."""

    rank: int = 0
    world_size: int = 1


@dataclass(frozen=True)
class KVNamespace:
    """Everything that changes the KV bytes of a token sequence.

    Invariant: the digest is that of the flat JSON object it has always been (`tp_rank`
    and `tp_world_size` at the top level, `group` only when set), so grouping fields here
    never moves a key: stored chunks stay findable."""

    model: str
    kv_dtype: str
    kv_layout: str
    chunk_tokens: int
    tp: TensorParallel = TensorParallel()
    salt: str = ""
    # One KV cache group of a hybrid model (its index, spec kind and geometry, e.g.
    # "1:sliding_window:w256:L1:b128"): groups never share records. Empty for a model
    # with one group, and then left out of the digest, so its keys stay as they were.
    group: str = ""

    def digest(self) -> bytes:
        """xxh3-128 of a canonical JSON encoding (sorted keys, no whitespace)."""
        fields: dict[str, str | int] = {
            "model": self.model, "kv_dtype": self.kv_dtype, "kv_layout": self.kv_layout,
            "chunk_tokens": self.chunk_tokens, "tp_rank": self.tp.rank,
            "tp_world_size": self.tp.world_size, "salt": self.salt}
        if self.group:
            fields["group"] = self.group
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_128_digest(text.encode())


def encode_tokens(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32; refuses ids that do not fit."""
    array = np.asarray(tokens)
    if array.size and (array.min() < 0 or array.max() > _MAX_TOKEN_ID):
        raise ValueError("token ids must be in [0, 2**32)")
    return array.astype("<u4", copy=False).tobytes()


def chunk_keys(
    tokens: Sequence[int] | np.ndarray,
    namespace: KVNamespace,
    parent: bytes = ROOT_KEY,
) -> list[bytes]:
    """Keys of every full chunk of `tokens`; a trailing partial chunk gets none.

    `parent` continues a chain: pass the key of the chunk before `tokens[0]`.
    """
    size = namespace.chunk_tokens
    encoded = encode_tokens(tokens)
    ns_digest = namespace.digest()
    step = size * 4
    keys = []
    previous = parent
    for start in range(0, len(encoded) - step + 1, step):
        hasher = xxhash.xxh3_128(previous)
        hasher.update(ns_digest)
        hasher.update(encoded[start : start + step])
        previous = hasher.digest()
        keys.append(previous)
    return keys
