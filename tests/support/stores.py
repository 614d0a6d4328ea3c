"""Stores for tests: chunk keys and payloads of one test namespace, disk-tier configs,
directories that take O_DIRECT, and loop devices (or a skip where the machine has none)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from bench.support.loopdev import LoopDevices, loop_devices_unavailable
from kvstore.format.keys import KVNamespace, chunk_keys
from kvstore.store.tiered import TieredStore

CHUNK_BYTES = 64 * 1024
NAMESPACE = KVNamespace(model="test-model", kv_dtype="uint8", kv_layout="flat", chunk_tokens=16)


def direct_io_dir(path: Path) -> str:
    """`path`, skipping the test where its filesystem does not take O_DIRECT (tmpfs)."""
    probe = path / "probe"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT)
        os.close(fd)
    except OSError:
        pytest.skip("the temporary directory's filesystem does not support O_DIRECT")
    probe.unlink()
    return str(path)


def require_loop_devices() -> None:
    reason = loop_devices_unavailable()
    if reason:
        pytest.skip(f"loop devices unavailable: {reason}")


@contextmanager
def attached(loops: LoopDevices) -> Iterator[LoopDevices]:
    """Attach loop devices for a test, or skip it where the machine cannot."""
    require_loop_devices()
    try:
        loops.__enter__()
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"loop devices unavailable: {exc.stderr.strip()}")
    try:
        yield loops
    finally:
        loops.__exit__()


def make_keys(count: int, seed: int = 0) -> list[bytes]:
    tokens = np.random.default_rng(seed).integers(0, 32000, count * NAMESPACE.chunk_tokens)
    return chunk_keys(tokens, NAMESPACE)


def make_payloads(count: int, seed: int = 0, chunk_bytes: int = CHUNK_BYTES) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + 1000)
    return [rng.integers(0, 256, chunk_bytes, dtype=np.uint8) for _ in range(count)]


def read_back(store: TieredStore, keys: list[bytes]) -> tuple[list[bool], list[np.ndarray]]:
    outs = [np.zeros(store.chunk_bytes, np.uint8) for _ in keys]
    return store.get_many(keys, outs), outs


def reads_back(store: TieredStore, keys: list[bytes], payloads: list[np.ndarray]) -> bool:
    """Whether every chunk is served, each byte for byte its payload."""
    ok, outs = read_back(store, keys)
    return all(ok) and all((o == p).all() for o, p in zip(outs, payloads, strict=True))


def disk_config(path: str, capacity: int | str, engine: str = "auto", dram: int | None = None,
                **extra) -> dict:
    """A store's config (no service): one disk tier at `path`, a DRAM tier of `dram` bytes
    if given, an I/O engine of queue depth 8 and a 5 s deadline."""
    tiers: dict = {"disk": [{"path": path, "capacity": capacity}]}
    if dram is not None:
        tiers["dram"] = {"capacity": dram}
    return {"tiers": tiers, "io": {"engine": engine, "queue_depth": 8, "timeout_s": 5}, **extra}
