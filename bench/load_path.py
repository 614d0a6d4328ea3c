"""Load-path throughput: kvstore's DRAM tier into an engine's paged KV, through the service.

This is what the vLLM connector does per request hit: the service copies each chunk
from its DRAM tier into the worker's shared-memory window (a `get`), then the paged
layout scatters the chunk into the request's KV blocks, layer by layer. Measured
through the connector's own code (WorkerCore.start_loads on a PagedKVLayout of vLLM's
CPU backend shape) against a real service, next to a plain torch copy of the same
bytes on the same machine (torch's copy_ on its intra-op threads, and a one-thread
memcpy through numpy), plus each half on its own (where the time goes).

  python -m bench.load_path [--chunks 16] [--layers 32] [--kv-heads 8] [--head-dim 128]
      [--chunk-tokens 256] [--block-size 128] [--repeats 5]
      [--blocks ascending|descending|shuffled] [--json out.json]

Defaults: Llama-3-8B's float16 KV geometry, 32 MiB chunks, 512 MiB per load. --blocks
is the order of the engine blocks loaded into: a fresh engine hands out ascending ids,
blocks freed by an earlier request come back descending, a long-running one's are mixed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from connectors.plan import Transfer
from connectors.worker_side import WorkerCore
from engine_plugin.layout import PagedKVLayout
from kvstore.config.store import StoreConfig, load_config
from kvstore.service.client import StoreClient, stop_service

GIB = 1 << 30


def _caches(layers: int, num_blocks: int, kv_heads: int, block_size: int, head_dim: int,
            fill: bool) -> dict[str, torch.Tensor]:
    """vLLM CPU backend KV tensors: per layer [num_blocks, kv_heads, block_size, 2 * head_dim]."""
    shape = (num_blocks, kv_heads, block_size, 2 * head_dim)
    make = (lambda: torch.randn(shape, dtype=torch.float16)) if fill else (
        lambda: torch.zeros(shape, dtype=torch.float16))
    return {f"model.layers.{i}.self_attn.attn": make() for i in range(layers)}


def _timed(repeats: int, action: Callable[[], None]) -> float:
    """Median seconds of `repeats` runs of `action`."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run(chunks: int = 16, layers: int = 32, kv_heads: int = 8, head_dim: int = 128,
        chunk_tokens: int = 256, block_size: int = 128, repeats: int = 5,
        blocks: str = "ascending", workdir: str | Path | None = None) -> dict[str, Any]:
    """Fill a DRAM-only service with `chunks` chunks, load them through the connector's
    worker code `repeats` times, and time the parts. Returns GiB/s figures and ratios."""
    blocks_per_chunk = chunk_tokens // block_size
    num_blocks = chunks * blocks_per_chunk
    source = PagedKVLayout(_caches(layers, num_blocks, kv_heads, block_size, head_dim, True),
                           num_blocks, blocks_per_chunk)
    target_caches = _caches(layers, num_blocks, kv_heads, block_size, head_dim, False)
    target = PagedKVLayout(target_caches, num_blocks, blocks_per_chunk)
    chunk_bytes = source.chunk_bytes
    order = {"ascending": list(range(num_blocks)), "descending": list(range(num_blocks))[::-1],
             "shuffled": torch.randperm(num_blocks).tolist()}[blocks]
    dest_blocks = tuple(tuple(order[c * blocks_per_chunk : (c + 1) * blocks_per_chunk])
                        for c in range(chunks))
    src_blocks = [tuple(range(c * blocks_per_chunk, (c + 1) * blocks_per_chunk)) for c in range(chunks)]
    keys = tuple(c.to_bytes(2, "little") * 8 for c in range(1, chunks + 1))

    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        config = load_config({
            "chunk_tokens": chunk_tokens,
            "tiers": {"host": {"capacity": (chunks + 2) * (chunk_bytes + (1 << 20))}},
            "service": {"socket": str(Path(tmp) / "kvstore.sock")}})
        try:
            return {**_measure(config, source, target, src_blocks, dest_blocks, keys, repeats),
                    "blocks": blocks}
        finally:
            stop_service(config)


def _measure(config: StoreConfig, source: PagedKVLayout, target: PagedKVLayout,
             src_blocks: list[tuple[int, ...]], dest_blocks: tuple[tuple[int, ...], ...],
             keys: tuple[bytes, ...], repeats: int) -> dict[str, Any]:
    chunk_bytes, chunks = source.chunk_bytes, len(keys)
    writer = StoreClient(config, chunk_bytes)
    try:
        for start in range(0, chunks, writer.slots):
            wave = range(start, min(start + writer.slots, chunks))
            for slot, c in enumerate(wave):
                source.gather(src_blocks[c], writer.slot(slot))
            assert all(writer.put([keys[c] for c in wave], range(len(wave))))
    finally:
        writer.close()

    worker = WorkerCore(target, 0, lambda: StoreClient(config, chunk_bytes), load_async=False)
    transfer = Transfer("bench", (keys,), (None,), dest_blocks)
    try:
        load_s = _timed(repeats, lambda: worker.start_loads([transfer], load_async=False))
        assert not worker.take_failed_blocks(), "a chunk failed to load"
        src_ids, dest_ids = [b for c in src_blocks for b in c], [b for c in dest_blocks for b in c]
        for src_layer, dest_layer in zip(source.layers, target.layers, strict=True):
            assert torch.equal(dest_layer[dest_ids], src_layer[src_ids]), "loaded KV differs"
        client = worker.loads.link.get()
        assert client is not None
        waves = [list(range(s, min(s + client.slots, chunks))) for s in range(0, chunks, client.slots)]

        def get_only() -> None:
            for wave in waves:
                client.get([keys[c] for c in wave], range(len(wave)))

        def scatter_only() -> None:  # the bytes land in the wrong blocks: timing only
            for wave in waves:
                for slot, c in enumerate(wave):
                    target.scatter(client.slot(slot), dest_blocks[c])

        get_s = _timed(repeats, get_only)
        scatter_s = _timed(repeats, scatter_only)
    finally:
        worker.close()

    src = torch.empty(chunks * chunk_bytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)

    def plain_copy() -> None:
        for c in range(chunks):
            dst[c * chunk_bytes : (c + 1) * chunk_bytes].copy_(src[c * chunk_bytes : (c + 1) * chunk_bytes])

    src_np, dst_np = src.numpy(), dst.numpy()

    def memcpy() -> None:  # numpy: one thread, as the layout copies on the CPU engine
        for c in range(chunks):
            dst_np[c * chunk_bytes : (c + 1) * chunk_bytes] = src_np[c * chunk_bytes : (c + 1) * chunk_bytes]

    copy_s = _timed(repeats, plain_copy)
    memcpy_s = _timed(repeats, memcpy)
    total = chunks * chunk_bytes / GIB
    return {"chunk_bytes": chunk_bytes, "chunks": chunks, "gib": total,
            "torch_threads": torch.get_num_threads(), "window_slots": len(waves[0]),
            "load_gib_s": total / load_s, "get_gib_s": total / get_s,
            "scatter_gib_s": total / scatter_s, "copy_gib_s": total / copy_s,
            "memcpy_gib_s": total / memcpy_s, "load_vs_copy": copy_s / load_s,
            "load_vs_memcpy": memcpy_s / load_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=128, help="vLLM's CPU backend: 128")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--blocks", choices=("ascending", "descending", "shuffled"), default="ascending",
                        help="order of the engine block ids loaded into")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    result = run(args.chunks, args.layers, args.kv_heads, args.head_dim, args.chunk_tokens,
                 args.block_size, args.repeats, args.blocks)
    print(f"{result['chunks']} chunks of {result['chunk_bytes'] / (1 << 20):.0f} MiB "
          f"({result['gib']:.2f} GiB), {args.blocks} blocks, "
          f"{result['torch_threads']} torch threads")
    for label, key in (("load (service get + scatter)", "load_gib_s"), ("service get alone", "get_gib_s"),
                       ("scatter alone", "scatter_gib_s"), ("plain torch copy", "copy_gib_s"),
                       ("memcpy (numpy, one thread)", "memcpy_gib_s")):
        print(f"  {label:30s} {result[key]:6.2f} GiB/s")
    print(f"  load / plain torch copy        {result['load_vs_copy']:6.2f}x")
    print(f"  load / memcpy                  {result['load_vs_memcpy']:6.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
