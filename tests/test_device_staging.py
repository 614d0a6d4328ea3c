"""The device tier: chunks staged into device memory ahead of a load, which then
copies them device to device and asks the service only for the rest. On this
machine the device is the CPU (the same code path); tests marked `cuda` run the
pinned-window, side-stream path where a GPU exists."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from support import services
from support.services import stop_service

from engine_plugin.vllm.core.device_staging import DeviceStagingPool
from engine_plugin.vllm.core.plan import Stage, Transfer
from engine_plugin.vllm.core.worker_side import WorkerCore
from engine_plugin.vllm.layout import PagedKVLayout
from kvstore.config.store import load_config
from kvstore.service.client import StoreClient

NUM_BLOCKS, BLOCKS_PER_CHUNK = 16, 2


def _sources(count: int, chunk_bytes: int, seed: int = 0) -> list[memoryview]:
    rng = np.random.default_rng(seed)
    return [memoryview(bytearray(rng.integers(0, 256, chunk_bytes, dtype=np.uint8).tobytes()))
            for _ in range(count)]


def _pool(slots: int, chunk_bytes: int = 4096, device: str = "cpu") -> DeviceStagingPool:
    return DeviceStagingPool(chunk_bytes, slots * chunk_bytes, torch.device(device))


def test_staged_chunks_are_taken_once_and_slots_come_back():
    pool = _pool(3)
    keys, sources = [bytes([i]) * 16 for i in range(3)], _sources(3, 4096)
    assert pool.stage(keys, sources) == (3, 0)
    assert pool.stage(keys[:1], sources[:1]) == (0, 0)  # already staged
    slot = pool.take(keys[1])
    assert slot is not None and bytes(pool.slot(slot).numpy()) == bytes(sources[1])
    assert pool.take(keys[1]) is None and keys[1] not in pool
    pool.release(slot)
    assert pool.stage([b"x" * 16], _sources(1, 4096, seed=1)) == (1, 0)  # the released slot


def test_a_full_pool_evicts_the_oldest_unused_chunk_but_never_a_taken_one():
    pool = _pool(2)
    keys = [bytes([i]) * 16 for i in range(4)]
    pool.stage(keys[:2], _sources(2, 4096))
    taken = pool.take(keys[0])
    # evicts keys[1], not the taken one
    assert pool.stage(keys[2:3], _sources(1, 4096, seed=2)) == (1, 1)
    assert keys[1] not in pool and keys[2] in pool
    assert pool.take(keys[2]) is not None
    assert pool.stage(keys[3:], _sources(1, 4096)) == (0, 0)  # both slots taken by loads
    pool.release(taken)


@pytest.fixture
def service_config(tmp_path, disk_dir):
    raw = services.service_config(tmp_path, dram="8MiB", disk_dir=disk_dir, disk="16MiB", io={"timeout_s": 5})
    yield raw
    stop_service(raw)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_load_uses_staged_chunks_and_fetches_only_the_rest(service_config, device):
    """Prefetch into the device tier (HBM on CUDA), then a load takes what was staged."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    caches = {f"layers.{i}": torch.randn(NUM_BLOCKS, 2, 16, 64).half() for i in range(2)}
    source = PagedKVLayout(caches, NUM_BLOCKS, BLOCKS_PER_CHUNK)
    config = load_config(service_config)
    keys = tuple(bytes([i + 1]) * 16 for i in range(4))
    blocks = ((0, 1), (2, 3), (4, 5), (6, 7))
    writer = StoreClient(config, source.chunk_bytes)
    for slot, chunk_blocks in enumerate(blocks):
        source.gather(chunk_blocks, writer.memory.slot(slot))
    assert writer.put(keys, range(4)) == [True] * 4
    writer.close()

    target_caches = {name: torch.zeros_like(t, device=device) for name, t in caches.items()}
    target = PagedKVLayout(target_caches, NUM_BLOCKS, BLOCKS_PER_CHUNK)
    pool = DeviceStagingPool(target.chunk_bytes, 8 * target.chunk_bytes, target.device)
    worker = WorkerCore(target, 0, partial(StoreClient, config, target.chunk_bytes),
                        staging=pool)
    try:
        staged = worker.start_stages([Stage("r", (keys[:3],))])
        assert staged is not None
        staged.result(timeout=30)
        assert all(k in pool for k in keys[:3]) and keys[3] not in pool
        load_blocks = ((8, 9), (10, 11), (12, 13), (14, 15))
        worker.start_loads([Transfer("r", (keys,), (None,), load_blocks, load_async=False)])
        if device == "cuda":
            torch.cuda.synchronize()
        assert worker.take_failed_blocks() == set()
        for name in caches:
            for src, dst in zip(blocks, load_blocks, strict=True):
                assert torch.equal(target_caches[name][list(dst)].cpu(), caches[name][list(src)])
        assert worker.stats.snapshot()["staging.hits"] == 3  # the fourth came from the service
        assert not any(k in pool for k in keys)  # taken by the load
    finally:
        worker.close()


@pytest.mark.cuda
def test_cuda_staging_round_trip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pool = _pool(4, chunk_bytes=1 << 20, device="cuda")
    assert pool.stream is not None
    sources = _sources(4, 1 << 20)
    keys = [bytes([i]) * 16 for i in range(4)]
    assert pool.stage(keys, sources) == (4, 0)
    for key, source in zip(keys, sources, strict=True):
        slot = pool.take(key)
        assert bytes(pool.slot(slot).cpu().numpy()) == bytes(source)
        pool.release(slot)
