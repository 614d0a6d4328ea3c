"""What naming KV with a collision-resistant hash costs (kvstore/format/keys.py), for
docs/architecture.md: chunk keys (SHA-256) against the xxh3-128 chain they replaced, and
an image's content name (engine_plugin/vllm/request_keys.py: SHA-256 over its processed
bytes) against a plain copy of those bytes,
each in the same run, and both against copying one chunk's KV at Llama-3-8B's geometry
(32 MiB per 256 tokens in bf16), the least a load of that chunk moves.

  python -m bench.lab key_cost [--chunk-tokens 256] [--image-mib 1.3 20]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

from bench.lab import Result
from kvstore.format.keys import ROOT_KEY, KVNamespace, chunk_keys, encode_tokens, key_digest

_CHUNKS = 4096  # chunks keyed per round
_KV_BYTES_PER_TOKEN = 128 << 10  # Llama-3-8B: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes


def _best(call: Callable[[], object], rounds: int = 5) -> float:
    """The fastest of `rounds` timings of `call`, in seconds."""
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best


def xxh3_chain(tokens: np.ndarray, namespace: KVNamespace) -> list[bytes]:
    """The key chain as key format 1 made it (xxh3-128), the baseline."""
    encoded, step = encode_tokens(tokens), namespace.chunk_tokens * 4
    text = json.dumps(namespace.fields(), sort_keys=True, separators=(",", ":"))
    digest, previous, keys = xxhash.xxh3_128_digest(text.encode()), ROOT_KEY, []
    for start in range(0, len(encoded) - step + 1, step):
        previous = xxhash.xxh3_128_digest(previous + digest + encoded[start : start + step])
        keys.append(previous)
    return keys


def measure(chunk_tokens: int, image_mib: list[float]) -> dict[str, float]:
    namespace = KVNamespace("model", "bfloat16", "NHD", chunk_tokens)
    tokens = np.random.default_rng(0).integers(0, 128_000, _CHUNKS * chunk_tokens, dtype=np.int64)
    kv = np.ones(chunk_tokens * _KV_BYTES_PER_TOKEN, np.uint8)
    kv_out = np.empty_like(kv)
    found: dict[str, float] = {
        "sha256_us_per_chunk": _best(lambda: chunk_keys(tokens, namespace)) / _CHUNKS * 1e6,
        "xxh3_us_per_chunk": _best(lambda: xxh3_chain(tokens, namespace)) / _CHUNKS * 1e6,
        "kv_copy_us_per_chunk": _best(lambda: np.copyto(kv_out, kv)) * 1e6,
    }
    for mib in image_mib:
        image = np.random.default_rng(1).random(int(mib * (1 << 20)) // 4, np.float32)
        copy = np.empty_like(image)
        found[f"image_{mib:g}MiB_name_ms"] = _best(functools.partial(key_digest, image.data)) * 1e3
        found[f"image_{mib:g}MiB_copy_ms"] = _best(functools.partial(np.copyto, copy, image)) * 1e3
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--image-mib", type=float, nargs="*", default=[1.3, 20.0],
                        help="processed image sizes (LLaVA-1.5's 336x336 pixels in fp32: 1.3 MiB)")


def experiment(args: argparse.Namespace, workdir: Path) -> Result:
    found = measure(args.chunk_tokens, args.image_mib)
    sha, xxh, kv = found["sha256_us_per_chunk"], found["xxh3_us_per_chunk"], found["kv_copy_us_per_chunk"]
    lines = [f"chunk keys ({args.chunk_tokens} tokens): SHA-256 {sha:.2f} us a chunk, {sha / xxh:.1f}x the "
             f"xxh3 chain ({xxh:.2f} us); {sha / kv:.5f} of copying the chunk's KV at 8B geometry "
             f"({kv / 1e3:.2f} ms)"]
    for mib in args.image_mib:
        name, copy = found[f"image_{mib:g}MiB_name_ms"], found[f"image_{mib:g}MiB_copy_ms"]
        lines.append(f"image of {mib:g} MiB processed: its content name {name:.2f} ms, {name / copy:.1f}x "
                     f"a plain copy of it ({copy:.2f} ms)")
    return Result("\n".join(lines), found)
