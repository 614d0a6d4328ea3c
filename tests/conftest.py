"""Shared fixtures: real O_DIRECT directories, both I/O engines, small chunk stores."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from bench.support.loopdev import LoopDevices, loop_devices_unavailable
from kvstore.devices.device import DATA_FILE
from kvstore.devices.layout import parse_superblock
from kvstore.format.keys import KVNamespace, chunk_keys
from kvstore.format.record import HEADER_BLOCK, HeaderState, RecordHeader, parse_header
from kvstore.io import make_engine
from kvstore.io.faulty import FaultyEngine
from kvstore.store.tiered import TieredStore

CHUNK_BYTES = 64 * 1024
MICRO_JSON = Path(".benchmarks") / "micro.json"  # under the root dir; gitignored
NAMESPACE = KVNamespace(model="test-model", kv_dtype="uint8", kv_layout="flat", chunk_tokens=16)


def pytest_collection_finish(session: pytest.Session) -> None:
    """When micro-benchmarks are about to run (tests/test_micro_bench.py, in the plain CI
    run too), their figures go to .benchmarks/micro.json unless --benchmark-json says
    where; a run without them writes nothing."""
    benchmarks = getattr(session.config, "_benchmarksession", None)
    if benchmarks is None or benchmarks.json or benchmarks.disabled or not any(
            "benchmark" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    benchmarks.json = session.config.rootpath / MICRO_JSON
    benchmarks.json.parent.mkdir(exist_ok=True)


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


@pytest.fixture
def disk_dir(tmp_path) -> str:
    """A directory on a filesystem that takes O_DIRECT (tmpfs does not)."""
    return direct_io_dir(tmp_path)


@pytest.fixture(params=["uring", "threads"])
def engine(request) -> str:
    return request.param


@pytest.fixture
def faulty(engine) -> Iterator[FaultyEngine]:
    """A real engine behind a fault injector; teardown frees anything left hanging."""
    wrapper = FaultyEngine(make_engine(engine, 8))
    yield wrapper
    wrapper.release()


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


def disk_config(path: str, capacity: int | str, engine: str = "auto", host: int | None = None,
                **extra) -> dict:
    tiers: dict = {"disk": [{"path": path, "capacity": capacity}]}
    if host is not None:
        tiers["host"] = {"capacity": host}
    return {"tiers": tiers, "io": {"engine": engine, "queue_depth": 8, "timeout_s": 5}, **extra}


@pytest.fixture
def store_factory() -> Iterator:
    """Opens stores and closes whatever a test left open."""
    opened: list[TieredStore] = []

    def open_store(config, chunk_bytes: int = CHUNK_BYTES, **kwargs) -> TieredStore:
        store = TieredStore(config, chunk_bytes, **kwargs)
        opened.append(store)
        return store

    yield open_store
    for store in opened:
        if store.probe.capacity("host") or store.probe.capacity("disk"):  # not closed yet
            store.close()


def _valid_records(f) -> Iterator[tuple[int, RecordHeader]]:
    """(offset, header) of each valid record in an open disk-tier data file, in slot order."""
    f.seek(0)
    _, superblock = parse_superblock(f.read(4096))
    assert superblock is not None
    for slot in range(superblock.num_slots):
        offset = superblock.data_offset + slot * superblock.slot_bytes
        f.seek(offset)
        state, header = parse_header(f.read(HEADER_BLOCK))
        if state is HeaderState.VALID and header is not None:
            yield offset, header


def disk_records(directory: str) -> list[RecordHeader]:
    """The headers of the valid records in a disk tier's data file, in slot order."""
    with open(os.path.join(directory, DATA_FILE), "rb") as f:
        return [header for _, header in _valid_records(f)]


def newest_chain_end(directory: str) -> bytes:
    """The key of the newest record (highest sequence number) that no record names as its
    parent, in a disk tier's data file: a last chunk of the prompt stored last."""
    headers = disk_records(directory)
    parents = {header.parent for header in headers}
    return max((h for h in headers if h.key not in parents), key=lambda h: h.seq).key


def corrupt_record(directory: str, payload_byte: int | None = None, key: bytes | None = None) -> None:
    """Flip one payload byte of the first valid record in a disk tier's data file (with
    `payload_byte`: of the first whose payload holds that byte where the flip goes; with
    `key`: of the record of that chunk key)."""
    with open(os.path.join(directory, DATA_FILE), "r+b") as f:
        for offset, header in list(_valid_records(f)):
            f.seek(offset + HEADER_BLOCK + 1000)
            byte = f.read(1)
            if payload_byte in (None, byte[0]) and key in (None, header.key):
                f.seek(offset + HEADER_BLOCK + 1000)
                f.write(bytes([byte[0] ^ 0xFF]))
                return
    raise AssertionError("no record found to corrupt")
