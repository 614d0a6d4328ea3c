"""Load-path throughput: kvstore's DRAM tier into an engine's paged KV, through the service.

This is what the vLLM connector does per request hit, through the connector's own code
(WorkerCore.start_loads on a PagedKVLayout of vLLM's CPU backend shape) against a real
service, in two ways, each with a service of its own:
  tier    (service.share_dram on, the default): the worker maps the DRAM tier read-only,
          the service pins the chunks' slots, the worker copies each chunk straight
          from its slot into the KV blocks (one copy);
  window  (service.share_dram off): the service copies each chunk into the worker's
          shared window, then the worker copies it into the blocks (two copies);
next to a plain copy of the same bytes on the same machine (torch's copy_ on its
intra-op threads, and a one-thread memcpy through numpy). The rounds alternate (load,
torch copy, memcpy, ...) and each figure is its best round, so drift on a shared
machine touches them all alike. With --disk, disk hits too: each chunk is read
(O_DIRECT) into a DRAM slot, then copied into the blocks from the slot (tier), its hash
taken as it is copied (the connector's own way: one pass over its bytes), or taken in the
service before it (a pass of its own), or not at all (verification off: the copy a load
needs anyway, the yardstick), or, hashed and copied in one pass, into the window first
(window); GiB/s (the best load) and the CPU seconds per GiB of worker and service together
(the median load). The three tier ways take turns in one service and worker; two sets of chunks
take turns in a DRAM tier that holds one, so each timed load reads its set from disk. Where CUDA is
present, also DRAM hits into KV tensors on the GPU (the tier registered for DMA as the
connector does it) against torch's pinned `copy_` of the same bytes (goal: >= 0.9x).

  python -m bench.lab load_path [--chunks 16] [--layers 32] [--kv-heads 8] [--head-dim 128]
      [--chunk-tokens 256] [--block-size 128] [--repeats 5]
      [--blocks ascending|descending|shuffled] [--disk DIR] [--json out.json]

Defaults: Llama-3-8B's float16 KV geometry, 32 MiB chunks, 512 MiB per load. --blocks
is the order of the engine blocks loaded into: a fresh engine hands out ascending ids,
blocks freed by an earlier request come back descending, a long-running one's are mixed.
The goal (issue 22): the tier load at >= 0.9x the plain torch copy.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.lab import Result
from bench.support.processes import process_cpu
from bench.support.vm import huge_pages
from engine_plugin.vllm.core.plan import Transfer
from engine_plugin.vllm.core.worker_side import WorkerCore
from engine_plugin.vllm.layout import PagedKVLayout
from kvstore.config.store import StoreConfig, load_config
from kvstore.format.record import record_bytes
from kvstore.service.client import StoreClient, stop_service

GIB = 1 << 30
# service.share_dram, then (result name, how the disk hits are verified: _Verifying) of the
# paths timed in alternated rounds in one service and worker
DISK_PATHS = (("own-user", (("disk_tier", "copy"), ("disk_tier_service", "service"),
                            ("disk_tier_off", "off"))),
              ("off", (("disk_window", "service"),)))


def _caches(layers: int, num_blocks: int, kv_heads: int, block_size: int, head_dim: int,
            fill: bool) -> dict[str, torch.Tensor]:
    """vLLM CPU backend KV tensors: per layer [num_blocks, kv_heads, block_size, 2 * head_dim]."""
    shape = (num_blocks, kv_heads, block_size, 2 * head_dim)
    make = (lambda: torch.randn(shape, dtype=torch.float16)) if fill else (
        lambda: torch.zeros(shape, dtype=torch.float16))
    return {f"model.layers.{i}.self_attn.attn": make() for i in range(layers)}


class _Verifying:
    """The target layout, verifying the disk hits a load copies `how`: "copy" (hashed as
    they are copied: the connector's own way), "service" (hashed in the service before
    they are copied: the layout says it cannot check its copies), "off" (not verified at
    all: the copy a load needs anyway, and a yardstick only, never a connector's way)."""

    def __init__(self, layout: PagedKVLayout, how: str) -> None:
        self.layout = layout
        self.how = how
        self.chunk_bytes = layout.chunk_bytes

    @property
    def checks_copies(self) -> bool:
        return self.how != "service"

    def gather(self, blocks: Sequence[int], out: memoryview, group: int = 0) -> None:
        self.layout.gather(blocks, out, group)

    def scatter(self, chunks: Sequence[tuple[memoryview | torch.Tensor, Sequence[int]]],
                group: int = 0, checks: Sequence[int | None] = ()) -> list[bool]:
        if self.how == "off":
            self.layout.scatter(chunks, group)
            return [True] * len(chunks)
        return self.layout.scatter(chunks, group, checks)


def _best(repeats: int, actions: dict[str, Callable[[], None]]) -> dict[str, float]:
    """Best seconds of each action over `repeats` rounds, the actions alternating."""
    best = dict.fromkeys(actions, float("inf"))
    for _ in range(repeats):
        for name, action in actions.items():
            started = time.perf_counter()
            action()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def run(chunks: int = 16, layers: int = 32, kv_heads: int = 8, head_dim: int = 128,
        chunk_tokens: int = 256, block_size: int = 128, repeats: int = 5,
        blocks: str = "ascending", workdir: str | Path | None = None,
        disk_dir: str | None = None) -> dict[str, Any]:
    """Fill a DRAM-only service with `chunks` chunks and load them through the connector's
    worker code, by the tier and by the window, each against plain copies in alternated
    rounds. Returns GiB/s figures and ratios."""
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

    src = torch.empty(chunks * chunk_bytes, dtype=torch.uint8).random_()
    dst = torch.zeros_like(src)
    src_np, dst_np = src.numpy(), dst.numpy()

    def plain_copy() -> None:
        for c in range(chunks):
            dst[c * chunk_bytes : (c + 1) * chunk_bytes].copy_(src[c * chunk_bytes : (c + 1) * chunk_bytes])

    def memcpy() -> None:  # numpy: one thread
        for c in range(chunks):
            dst_np[c * chunk_bytes : (c + 1) * chunk_bytes] = src_np[c * chunk_bytes : (c + 1) * chunk_bytes]

    result: dict[str, Any] = {"chunk_bytes": chunk_bytes, "chunks": chunks, "blocks": blocks,
                              "gib": chunks * chunk_bytes / GIB, "torch_threads": torch.get_num_threads()}
    setup = _Setup(source, target, src_blocks, dest_blocks, keys, chunk_tokens, repeats)
    for path, share in (("tier", "own-user"), ("window", "off")):
        with tempfile.TemporaryDirectory(dir=workdir) as tmp:
            config = _config(chunk_tokens, tmp, share, dram_bytes=chunks * chunk_bytes + (64 << 20))
            best = _dram_rounds(setup, config, partial(StoreClient, config, chunk_bytes), path == "tier",
                                {"copy": plain_copy, "memcpy": memcpy})
        result[f"{path}_gib_s"] = result["gib"] / best["load"]
        result[f"{path}_copy_gib_s"] = result["gib"] / best["copy"]
        result[f"{path}_memcpy_gib_s"] = result["gib"] / best["memcpy"]
        result[f"{path}_vs_copy"] = best["copy"] / best["load"]
        result[f"{path}_vs_memcpy"] = best["memcpy"] / best["load"]
    if torch.cuda.is_available():
        result.update(_cuda_rounds(setup, workdir))
    if disk_dir is not None:
        # Both DRAM slabs in huge pages where root can reserve them: a disk read into 4 KiB
        # pages splits at the device's segment limit, and the shared slab (a memfd) gets
        # transparent huge pages only where shmem_enabled allows, the private one always.
        slab_and_windows = chunks * record_bytes(chunk_bytes) + 3 * (256 << 20)
        with huge_pages(slab_and_windows) as why_not:
            result["disk_huge_pages"] = why_not or "reserved"
            for share, paths in DISK_PATHS:
                result.update(_disk_rounds(setup, share, paths, disk_dir))
        result["disk_tier_vs_window"] = result["disk_tier_gib_s"] / result["disk_window_gib_s"]
        unverified = result["disk_tier_off_cpu_s_per_gib"]
        for path in ("disk_tier", "disk_tier_service"):  # the CPU of verifying, against none
            result[f"{path}_cpu_vs_off"] = result[f"{path}_cpu_s_per_gib"] / unverified
    return result


@dataclass(frozen=True)
class _Setup:
    """One run's chunks: the blocks they are gathered from (`source`), the engine's blocks
    they load into (`target`, `dest_blocks`), their keys, and how many rounds to time."""

    source: PagedKVLayout
    target: PagedKVLayout
    src_blocks: list[tuple[int, ...]]
    dest_blocks: tuple[tuple[int, ...], ...]
    keys: tuple[bytes, ...]
    chunk_tokens: int
    repeats: int

    def load(self, worker: WorkerCore, keys: tuple[bytes, ...] | None = None) -> None:
        """Load `keys` (default: this run's) into the destination blocks, as the connector does."""
        worker.start_loads([Transfer("bench", (keys or self.keys,), (None,), self.dest_blocks,
                                     load_async=False)])
        assert not worker.take_failed_blocks(), "a chunk failed to load"


def _dram_rounds(setup: _Setup, config: StoreConfig, make_client: Callable[..., StoreClient],
                 tier: bool, yardsticks: dict[str, Callable[[], None]],
                 after_load: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Fill the service's DRAM tier, then time the load (the worker mapping the tier or
    not, as `tier` says) against the yardsticks in alternated rounds; best seconds of each."""
    try:
        _fill(config, setup.source, setup.src_blocks, setup.keys)
        worker = WorkerCore(setup.target, 0, make_client)
        try:
            client = worker.loads.link.get()
            assert client is not None and (client.memory.tier is not None) == tier

            def load() -> None:
                setup.load(worker)
                after_load()

            best = _best(setup.repeats, {"load": load, **yardsticks})
            _check(setup.source, setup.target, setup.src_blocks, setup.dest_blocks)
        finally:
            worker.close()
    finally:
        stop_service(config)
    return best


def _cuda_rounds(setup: _Setup, workdir: str | Path | None) -> dict[str, float]:
    """DRAM hits into KV tensors on the GPU, from the tier registered as the connector
    registers it, against torch's pinned-memory `copy_` of the same bytes to the GPU."""
    from engine_plugin.vllm.cuda_host import register_for_dma

    chunk_bytes, chunks = setup.source.chunk_bytes, len(setup.keys)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros_like(layer, device="cuda")
              for i, layer in enumerate(setup.source.layers)}
    target = PagedKVLayout(caches, setup.source.layers[0].shape[0], len(setup.src_blocks[0]))
    pinned = torch.empty(chunks * chunk_bytes, dtype=torch.uint8, pin_memory=True).random_()
    device = torch.empty(chunks * chunk_bytes, dtype=torch.uint8, device="cuda")

    def pinned_copy() -> None:
        for c in range(chunks):
            device[c * chunk_bytes : (c + 1) * chunk_bytes].copy_(
                pinned[c * chunk_bytes : (c + 1) * chunk_bytes], non_blocking=True)
        torch.cuda.synchronize()

    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        config = _config(setup.chunk_tokens, tmp, "own-user", dram_bytes=chunks * chunk_bytes + (64 << 20))

        def make_client(map_tier: bool) -> StoreClient:
            client = StoreClient(config, chunk_bytes, map_tier=map_tier)
            registration = register_for_dma(client.memory)
            if registration.thread is not None:
                registration.thread.join()  # registered before the timed rounds, as once serving
            return client

        best = _dram_rounds(replace(setup, target=target), config, make_client, True,
                            {"pinned": pinned_copy}, torch.cuda.synchronize)
    gib = chunks * chunk_bytes / GIB
    return {"cuda_tier_gib_s": gib / best["load"], "cuda_pinned_copy_gib_s": gib / best["pinned"],
            "cuda_tier_vs_pinned_copy": best["pinned"] / best["load"]}


def _config(chunk_tokens: int, directory: str, share: str, dram_bytes: int,
            disk_bytes: int = 0) -> StoreConfig:
    tiers: dict[str, Any] = {"dram": {"capacity": dram_bytes}}
    if disk_bytes:
        tiers["disk"] = [{"path": directory, "capacity": disk_bytes}]
    return load_config({"chunk_tokens": chunk_tokens, "tiers": tiers,
                        "service": {"socket": str(Path(directory) / "kvstore.sock"), "share_dram": share}})


def _disk_rounds(setup: _Setup, share: str, paths: Sequence[tuple[str, str]],
                 disk_dir: str) -> dict[str, float]:
    """Disk hits: two sets of chunks on disk and a DRAM tier that holds one set; each
    load of a set (timed) pushes the other out of DRAM, so every load reads its set from
    disk, in one service and worker as when serving. The `paths` (name, how verified:
    _Verifying) take turns in each round, so drift on a shared machine touches them all
    alike. CPU seconds are the worker's and the service's together, over the timed load:
    the median load's (a load's CPU varies by a tenth from one to the next, and the best
    of each path's would compare outliers); GiB/s is the best load's."""
    keys, chunk_bytes = setup.keys, setup.source.chunk_bytes
    slot_bytes = record_bytes(chunk_bytes)
    others = tuple(bytes(b ^ 0xFF for b in key) for key in keys)
    best = dict.fromkeys((name for name, _ in paths), float("inf"))
    cpu: dict[str, list[float]] = {name: [] for name, _ in paths}
    with tempfile.TemporaryDirectory(dir=disk_dir) as tmp:
        config = _config(setup.chunk_tokens, tmp, share, dram_bytes=len(keys) * slot_bytes,
                         disk_bytes=2 * len(keys) * slot_bytes + (64 << 20))
        _fill(config, setup.source, setup.src_blocks, keys)
        _fill(config, setup.source, setup.src_blocks, others)
        stop_service(config)  # DRAM's chunks go down to disk
        layout = _Verifying(setup.target, paths[0][1])
        worker = WorkerCore(layout, 0, partial(StoreClient, config, chunk_bytes))
        try:
            client = worker.loads.link.get()
            assert client is not None and (client.memory.tier is not None) == (share != "off")
            service_pid = int(client.info()["service_pid"])
            for _ in range(setup.repeats):
                for name, verify in paths:
                    layout.how = verify
                    for chunks in (others, keys):
                        before = client.info()["counters"]
                        cpu_before = time.process_time() + process_cpu(service_pid)
                        started = time.perf_counter()
                        setup.load(worker, chunks)
                        seconds = time.perf_counter() - started
                        cpu_s = time.process_time() + process_cpu(service_pid) - cpu_before
                        after = client.info()["counters"]
                        disk_hits, leased = (after.get(counter, 0) - before.get(counter, 0)
                                             for counter in ("disk.hits", "dram.leased"))
                        assert disk_hits == len(keys), f"{disk_hits} of {len(keys)} chunks came from disk"
                        wanted = disk_hits if share != "off" else 0
                        assert leased == wanted, f"{leased} chunks leased"
                        best[name] = min(best[name], seconds)
                        cpu[name].append(cpu_s)
                    _check(setup.source, setup.target, setup.src_blocks, setup.dest_blocks)
        finally:
            worker.close()
            stop_service(config)
    gib = len(keys) * chunk_bytes / GIB
    result: dict[str, float] = {}
    for name, _ in paths:
        result.update({f"{name}_gib_s": gib / best[name],
                       f"{name}_cpu_s_per_gib": statistics.median(cpu[name]) / gib})
    return result


def _fill(config: StoreConfig, source: PagedKVLayout, src_blocks: list[tuple[int, ...]],
          keys: tuple[bytes, ...]) -> None:
    """Put every chunk into the service's DRAM tier, a window at a time."""
    writer = StoreClient(config, source.chunk_bytes)
    try:
        for start in range(0, len(keys), writer.memory.slots):
            wave = range(start, min(start + writer.memory.slots, len(keys)))
            for slot, c in enumerate(wave):
                source.gather(src_blocks[c], writer.memory.slot(slot))
            assert all(writer.put([keys[c] for c in wave], range(len(wave))))
    finally:
        writer.close()


def _check(source: PagedKVLayout, target: PagedKVLayout, src_blocks: list[tuple[int, ...]],
           dest_blocks: tuple[tuple[int, ...], ...]) -> None:
    src_ids, dest_ids = [b for c in src_blocks for b in c], [b for c in dest_blocks for b in c]
    for src_layer, dest_layer in zip(source.layers, target.layers, strict=True):
        assert torch.equal(dest_layer[dest_ids].cpu(), src_layer[src_ids]), "loaded KV differs"
        dest_layer.zero_()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=128, help="vLLM's CPU backend: 128")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--blocks", choices=("ascending", "descending", "shuffled"), default="ascending",
                        help="order of the engine block ids loaded into")
    parser.add_argument("--disk", metavar="DIR",
                        help="also load disk hits: a directory on a filesystem that takes O_DIRECT")


def experiment(args: argparse.Namespace, workdir: Path) -> Result:
    result = run(args.chunks, args.layers, args.kv_heads, args.head_dim, args.chunk_tokens,
                 args.block_size, args.repeats, args.blocks, workdir=workdir, disk_dir=args.disk)
    return Result(table(result, args.blocks), result)


def table(result: dict[str, Any], blocks: str) -> str:
    lines = [f"{result['chunks']} chunks of {result['chunk_bytes'] / (1 << 20):.0f} MiB "
             f"({result['gib']:.2f} GiB), {blocks} blocks, {result['torch_threads']} torch threads; "
             "best of alternated rounds",
             f"  {'path':44s} {'GiB/s':>6s} {'torch copy':>10s} {'memcpy':>7s} {'load/copy':>9s} "
             f"{'load/memcpy':>11s}"]
    for path, label in (("tier", "tier: one copy from the pinned DRAM slot"),
                        ("window", "window: service copy, then worker copy")):
        lines.append(f"  {label:44s} {result[path + '_gib_s']:6.2f} {result[path + '_copy_gib_s']:10.2f} "
                     f"{result[path + '_memcpy_gib_s']:7.2f} {result[path + '_vs_copy']:8.2f}x "
                     f"{result[path + '_vs_memcpy']:10.2f}x")
    lines.append(f"  goal: tier load >= 0.9x the plain torch copy: {result['tier_vs_copy']:.2f}x "
                 f"({'met' if result['tier_vs_copy'] >= 0.9 else 'missed'})")
    if "cuda_tier_gib_s" in result:
        lines.append(f"  CUDA: tier -> GPU blocks {result['cuda_tier_gib_s']:.2f} GiB/s, pinned copy_ "
                     f"{result['cuda_pinned_copy_gib_s']:.2f} GiB/s: "
                     f"{result['cuda_tier_vs_pinned_copy']:.2f}x (goal >= 0.9x: "
                     f"{'met' if result['cuda_tier_vs_pinned_copy'] >= 0.9 else 'missed'})")
    if "disk_tier_gib_s" in result:
        lines.append(f"  disk hits (O_DIRECT reads; huge pages: {result['disk_huge_pages']}):  {'GiB/s':>6s} "
                     f"{'CPU s/GiB':>10s}")
        for path, label in (("disk_tier", "into the DRAM slot, verified as copied out of it"),
                            ("disk_tier_service", "into the DRAM slot, verified there, then copied"),
                            ("disk_tier_off", "into the DRAM slot, copied unverified (yardstick)"),
                            ("disk_window", "into the DRAM slot, copied via the window")):
            lines.append(f"  {label:60s} {result[path + '_gib_s']:6.2f} "
                         f"{result[path + '_cpu_s_per_gib']:10.3f}")
        lines.append(f"  disk tier / disk window: {result['disk_tier_vs_window']:.2f}x  (CPU: worker and "
                     "service together)")
        lines.append(f"  CPU of a verified disk hit against an unverified one: "
                     f"{result['disk_tier_cpu_vs_off']:.2f}x verified as copied, "
                     f"{result['disk_tier_service_cpu_vs_off']:.2f}x verified in the service (goal <= 1.15x)")
    return "\n".join(lines)
