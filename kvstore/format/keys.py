"""Content-addressed chunk keys.

A prompt is cut into chunks of `chunk_tokens` tokens. Chunk i's key is SHA-256 over
(key of chunk i-1, namespace digest, chunk i's token ids as little-endian uint32),
cut to KEY_BYTES. Chaining makes a key stand for the whole prefix up to and including
its chunk, which is what KV depends on; the namespace digest keeps KV of different
models, weights, dtypes, layouts or tensor-parallel shards apart. Only stable byte
encodings go in, so keys agree across processes, hosts and restarts.

Keys come from a collision-resistant hash (`key_digest`, as vLLM keys its own prefix
cache with SHA-256) because a client chooses what is hashed: with a fast
non-cryptographic hash, two inputs with one key can be built by hand, and the KV stored
for one is then served for the other. Checksums of stored bytes stay xxh3 (they guard
against rot, not against a chosen input: kvstore/format/record.py). This is key format
KEY_FORMAT; the tiers' on-disk formats carry it (a tier written under older keys is
started empty, never read as this one: kvstore/devices/layout.py).

What the token ids do not show (an image behind its placeholder tokens, prompt
embeddings) is a chunk's extra bytes (`KeyExtras.chunk`), folded in after its tokens,
as vLLM folds `generate_block_hash_extra_keys` into its block hashes. Invariant: a
chunk with no extra bytes hashes exactly as it always has, so text-only keys and the
chunks stored under them stay valid; a chunk with some hashes more bytes than any
text-only chunk, so the two never meet; the chain carries a chunk's extras into every
later key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

KEY_BYTES = 16
KEY_FORMAT = 2  # 1: xxh3-128 keys (never read as these)
ROOT_KEY = bytes(KEY_BYTES)  # the "previous key" of chunk 0
_MAX_TOKEN_ID = (1 << 32) - 1
_EXTRA_TAG = b"KVX1"  # opens a chunk's extra bytes in its hash input


@dataclass(frozen=True)
class TensorParallel:
    """Which shard of a tensor-parallel model's KV heads a rank holds: `rank` of
    `world_size` (each rank's KV is its own, so each has its own keys)."""

    rank: int = 0
    world_size: int = 1


@dataclass(frozen=True)
class Shard:
    """Which part of a model's KV a namespace holds: a tensor-parallel rank's heads, and
    one KV cache group of a hybrid model (its index, spec kind and geometry, e.g.
    "1:sliding_window:w256:L1:b128"): shards never share records. `group` is empty for
    a model with one group, and then left out of the digest, so its keys stay as they were."""

    tp: TensorParallel = TensorParallel()
    group: str = ""


@dataclass(frozen=True)
class Weights:
    """Which weights compute the KV: `fingerprint` names the checkpoint (a digest of its
    files, connectors/weights.py, or the operator's `model_revision`); `generation` is a
    random nonce a running engine draws when its weights change in place (a counter would
    let two engines that updated differently meet). Each is left out of the digest when
    empty."""

    fingerprint: str = ""
    generation: str = ""


@dataclass(frozen=True)
class KVNamespace:
    """Everything that changes the KV bytes of a token sequence.

    Invariant: the digest is that of the flat JSON object it has always been (`tp_rank`
    and `tp_world_size` at the top level; `group`, `weights` and `generation` only when
    set), so grouping fields here never moves a key: stored chunks stay findable."""

    model: str
    kv_dtype: str
    kv_layout: str
    chunk_tokens: int
    shard: Shard = Shard()
    salt: str = ""
    weights: Weights = Weights()

    def digest(self) -> bytes:
        """key_digest of a canonical JSON encoding (sorted keys, no whitespace)."""
        text = json.dumps(self.fields(), sort_keys=True, separators=(",", ":"))
        return key_digest(text.encode())

    def fields(self) -> dict[str, str | int]:
        """The flat JSON object the digest is taken of (optional fields only when set)."""
        fields: dict[str, str | int] = {
            "model": self.model, "kv_dtype": self.kv_dtype, "kv_layout": self.kv_layout,
            "chunk_tokens": self.chunk_tokens, "tp_rank": self.shard.tp.rank,
            "tp_world_size": self.shard.tp.world_size, "salt": self.salt}
        optional = {"group": self.shard.group, "weights": self.weights.fingerprint,
                    "generation": self.weights.generation}
        fields.update((name, value) for name, value in optional.items() if value)
        return fields

    def description(self) -> dict[str, str | int]:
        """What the service is told about this namespace (kvstore/service/namespaces.py): its
        fields, the salt (a LoRA adapter and cache salt: it may name a user) as a digest."""
        fields = self.fields()
        fields["salt"] = key_digest(self.salt.encode())[:8].hex() if self.salt else ""
        return fields


def key_digest(*parts: bytes | memoryview) -> bytes:
    """SHA-256 of the parts, one after the other, cut to KEY_BYTES: every key and
    namespace digest kvstore makes from what an engine or a client names. Callers give
    inputs whose parts cannot be read two ways (fixed lengths, or a separator the parts
    cannot hold)."""
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(part)
    return hasher.digest()[:KEY_BYTES]


def encode_tokens(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32; refuses ids that do not fit."""
    array = np.asarray(tokens)
    if array.size and (array.min() < 0 or array.max() > _MAX_TOKEN_ID):
        raise ValueError("token ids must be in [0, 2**32)")
    return array.astype("<u4", copy=False).tobytes()


@dataclass(frozen=True)
class Placeholder:
    """Placeholder tokens standing for an input the token ids do not show (an image, an
    audio clip): `identifier` names that input's content (vLLM's `mm_feature.identifier`),
    `offset` and `length` are where its tokens sit in the prompt (vLLM's `mm_position`)."""

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.identifier, str) or not self.identifier:
            raise ValueError(f"a placeholder's identifier must be a non-empty string, "
                             f"got {self.identifier!r}")
        for name in ("offset", "length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"a placeholder's {name} must be an integer >= 0, got {value!r}")


@dataclass(frozen=True)
class KeyExtras:
    """What shapes one request's KV besides its token ids and namespace, chunk by chunk.

    `placeholders`: inputs behind placeholder tokens; a chunk overlapping one folds in
    its identifier and its offset from the chunk's start (negative when it began in an
    earlier chunk), as vLLM's `_gen_mm_extra_hash_keys` does per block, so the same
    image at another offset, or another image at the same one, gives other keys.
    `embeds[i]`: a digest of chunk i's prompt embeddings (empty: none).
    """

    placeholders: tuple[Placeholder, ...] = ()
    embeds: tuple[bytes, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.placeholders or self.embeds)

    def chunk(self, index: int, chunk_tokens: int) -> bytes:
        """Chunk `index`'s extra bytes (b"" when it has none): one field per placeholder
        it overlaps, in the given order, then its embeddings' digest; each field a tag,
        a length and its bytes, so no two different lists encode alike."""
        start, end = index * chunk_tokens, (index + 1) * chunk_tokens
        out = bytearray()
        for item in self.placeholders:
            if item.offset < end and item.offset + item.length > start:
                where = (item.offset - start).to_bytes(8, "little", signed=True)
                _field(out, b"M", item.identifier.encode() + where)
        if index < len(self.embeds) and self.embeds[index]:
            _field(out, b"E", self.embeds[index])
        return bytes(out)


def _field(out: bytearray, tag: bytes, body: bytes) -> None:
    out += tag + len(body).to_bytes(4, "little") + body


def chunk_keys(
    tokens: Sequence[int] | np.ndarray,
    namespace: KVNamespace,
    parent: bytes = ROOT_KEY,
    extras: KeyExtras | None = None,
    first: int = 0,
) -> list[bytes]:
    """Keys of every full chunk of `tokens`; a trailing partial chunk gets none.

    `parent` continues a chain: pass the key of the chunk before `tokens[0]`, and
    `first`, that chunk's index + 1 (where `extras` counts chunks from).
    """
    size = namespace.chunk_tokens
    encoded = encode_tokens(tokens)
    ns_digest = namespace.digest()
    step = size * 4
    keys = []
    previous = parent
    for index, start in enumerate(range(0, len(encoded) - step + 1, step), first):
        extra = extras.chunk(index, size) if extras else b""
        tail = (_EXTRA_TAG + len(extra).to_bytes(8, "little"), extra) if extra else ()
        previous = key_digest(previous, ns_digest, encoded[start : start + step], *tail)
        keys.append(previous)
    return keys
