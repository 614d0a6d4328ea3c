"""Request traces in the Mooncake format (JSONL), turned into chained chunk keys.

One JSON object a line: `timestamp` (ms), `input_length`, `output_length` (tokens),
`hash_ids` (one id per `block_tokens`-token prefix block; equal ids at equal
positions mean a shared prefix). No token ids are given, so a block's key is
chained over the ids the way kvstore chains token chunks: key_i depends on every
id before it, and two requests share key_i exactly when they share ids [0..i].
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvstore.format.errors import KVStoreError

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    keys: tuple[bytes, ...]  # one per *full* block of the prompt


def block_keys(hash_ids: list[int]) -> tuple[bytes, ...]:
    keys, previous = [], bytes(16)
    for block_id in hash_ids:
        previous = xxhash.xxh3_128_digest(previous + int(block_id).to_bytes(8, "little", signed=True))
        keys.append(previous)
    return tuple(keys)


def read_trace(path: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
               limit: int | None = None) -> Iterator[TraceRequest]:
    """Requests in file order; a partial last block gets no key (it is never stored)."""
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if limit is not None and number > limit:
                return
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                input_tokens = int(row["input_length"])
                hash_ids = list(row["hash_ids"])
                request = TraceRequest(arrival_s=float(row["timestamp"]) / 1000.0,
                                       input_tokens=input_tokens,
                                       output_tokens=int(row.get("output_length", 0)),
                                       keys=block_keys(hash_ids[: input_tokens // block_tokens]))
            except (ValueError, KeyError, TypeError) as exc:
                raise KVStoreError(f"{path}:{number}: not a Mooncake trace line ({exc})") from exc
            yield request
