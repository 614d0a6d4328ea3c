"""The connector's configuration: a kvstore config plus a few engine-side options.

An engine passes one mapping (vLLM: `kv_connector_extra_config`). Its `config` key
names a kvstore YAML/JSON file or holds the config inline; without `config`, the
store keys may sit at the top level. The engine-side keys, their defaults and their
meaning are the fields of ConnectorOptions (and PrefetchPolicy's `prefetch_*` keys);
docs/vllm.md's table of them is generated from these models.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from engine_plugin.vllm.core.prefetch import PrefetchPolicy
from kvstore.config.schema import Bool, Refused, Schema, Text, cpu_list, integer, seconds, size, validate
from kvstore.config.store import StoreConfig, load_config
from kvstore.format.errors import ConfigError


class ConnectorOptions(Schema):
    """The engine plugin's options, as given in `kv_connector_extra_config`."""

    store: StoreConfig = Field(
        alias="config", description="a kvstore YAML/JSON file, or the config as a mapping (its keys may "
                                    "also sit at the top level, without `config`)",
        json_schema_extra={"doc_type": "file or mapping"})
    load_async: Bool = Field(
        True, description="read chunks while the request waits outside the batch (vLLM's "
                          "`WAITING_FOR_REMOTE_KVS`); false: read them just before the forward pass "
                          "that needs them (not on a model with more than one KV cache group, whose "
                          "loads are always async: see \"What happens on failure\")")
    sync_dram_loads: Bool = Field(
        True, description="a hit the scheduler's lookup leased whole (its chunks pinned in the DRAM tier: "
                          "a copy, no I/O) loads before the forward pass of the step that computes the "
                          "rest, one engine step sooner than an async load (it holds that step for the "
                          "copy); false: every load as `load_async` says",
        json_schema_extra={"doc_type": "true/false", "doc_default": "true"})
    model_id: Text | None = Field(
        None, description="the model identity in chunk keys (none: the engine's model path); set it "
                          "when one model is served from different paths, so they share chunks",
        json_schema_extra={"doc_default": "the model path"})
    model_revision: Text | None = Field(
        None, description="the weights' identity in chunk keys, instead of a fingerprint of the "
                          "checkpoint's files (SHA-256 over its safetensors and config files, cached by "
                          "file: see [vllm.md](vllm.md#weights-in-the-key)); give a new one whenever "
                          "the weights change",
        json_schema_extra={"doc_default": "a fingerprint of the weight files"})
    trust_client_mm_uuids: Bool = Field(
        False, description="key images (and other multimodal inputs) by the identifier vLLM gives them, "
                           "which a client may choose (a chat request's `uuid`), instead of by a digest "
                           "of their content: uuids are then shared keys across every engine and "
                           "restart of this store (a client that reuses another's uuid for another "
                           "image is served that image's KV); isolate tenants with cache_salt",
        json_schema_extra={"doc_type": "true/false", "doc_default": "false"})
    prefetch: PrefetchPolicy | None = Field(
        default_factory=PrefetchPolicy,
        description="a request's arrival (vLLM's `on_new_request`) starts promoting its stored chunks "
                    "from disk to DRAM in the service, so a request that waits to be scheduled (a busy "
                    "engine) is loaded from DRAM; so do hints and finished requests (their prompts are "
                    "kept warm); false: disk chunks are read when the load runs",
        json_schema_extra={"doc_type": "true/false", "doc_default": "true"})
    device_staging: Annotated[int, size(0)] = Field(
        0, description="bytes of a device-memory pool (HBM; CPU memory on the CPU engine) per worker "
                       "into which arriving requests' chunks are staged; loads copy them device to "
                       "device (engine_plugin/vllm/core/device_staging.py); 0: off")
    load_copy_cpus: Annotated[tuple[int, ...], cpu_list()] = Field(
        (), description="CPUs a CPU engine's worker may also copy a load on, beside the cores vLLM binds "
                        "it to (one on a small machine): name only CPUs no engine thread busy-polls, "
                        "such as those vLLM keeps for its front end (`VLLM_CPU_NUM_OF_RESERVED_CPU`); "
                        "see [A CPU engine's loads](#a-cpu-engines-loads-streaming-copies-and-huge-pages); "
                        "none: the worker's own cores only")
    lookup_timeout_s: Annotated[float, seconds()] = Field(
        1.0, description="deadline of one scheduler lookup (it runs on the scheduler's thread): a slow "
                         "or hung service costs a request at most this, then a miss")
    wait_for_saves_s: Annotated[float, seconds(zero=True)] = Field(
        5.0, description="the longest a request is held (asked again later) while chunks of its prefix "
                         "that an earlier request computed are still on their way to the store; 0: "
                         "never held")
    save_answers: Bool = Field(
        True, description="chunks filled with generated tokens are saved like prompt chunks, so the next "
                           "turn of a conversation (prompt + answer + new message) finds the answer in "
                           "the store; false: only prompt chunks are saved",
        json_schema_extra={"doc_type": "true/false", "doc_default": "true"})
    sliding_window_interval: Annotated[int, integer(0, 1 << 24)] = Field(
        4096, description="tokens: a hybrid model's sliding-window groups store the chunks inside "
                          "the window before the prompt's end, before each answer chunk and before "
                          "every multiple of this (a later prompt sharing a prefix hits at one of "
                          "those); a multiple of `chunk_tokens`, or 0: only the prompt's end and "
                          "answers; `chunk_tokens`: every chunk (engine_plugin/vllm/core/groups.py)")
    save_window_wait_s: Annotated[float, seconds(zero=True)] = Field(
        2.0, description="the longest one step waits for free window slots when it computed more "
                         "chunks than the window holds (saves go in waves); past it the rest is "
                         "dropped, counted in `save.dropped`")
    pd_wait_s: Annotated[float, seconds(zero=True)] = Field(
        5.0, description="prefill/decode disaggregation: the longest a request that a prefill instance "
                         "handed off (its `kv_transfer_params`) is held until the chunks the prefill "
                         "named are readable here; past it the rest is recomputed. See [pd.md](pd.md)")
    pd_consumer_saves: Bool = Field(
        False, description="a `kv_consumer` saves chunks like `kv_both` (its prompts' last chunks, what "
                           "it generates); false: it only loads. See [pd.md](pd.md)",
        json_schema_extra={"doc_type": "true/false", "doc_default": "false"})

    @classmethod
    def written_keys(cls) -> set[str]:
        return super().written_keys() | PrefetchPolicy.written_keys()

    @classmethod
    def reshape(cls, data: Any) -> Any:
        """`prefetch: true|false` and the `prefetch_*` keys make the policy (or None)."""
        if not isinstance(data, dict):
            return data
        policy_keys = PrefetchPolicy.written_keys()
        options = {key: value for key, value in data.items() if key not in policy_keys}
        enabled = options.get("prefetch", True)
        if not isinstance(enabled, bool):
            raise Refused("must be true or false", "prefetch", value=enabled)
        policy = PrefetchPolicy(**{key: value for key, value in data.items() if key in policy_keys})
        return {**options, "prefetch": policy if enabled else None}


def parse_options(extra: dict[str, Any] | None) -> ConnectorOptions:
    options = dict(extra or {})
    if "config" in options:
        source = options.pop("config")
    else:  # the store keys at the top level
        engine_keys = ConnectorOptions.written_keys()
        source = {key: options.pop(key) for key in list(options) if key not in engine_keys}
    if not source:
        raise ConfigError("config", None, "required: a kvstore config file or mapping")
    return validate(ConnectorOptions, {**options, "config": load_config(source)})


def check_chunk_size(chunk_tokens: int, block_size: int) -> int:
    """Blocks per chunk; a chunk must cover whole engine blocks (a load fills blocks)."""
    if chunk_tokens % block_size:
        raise ConfigError("chunk_tokens", chunk_tokens,
                          f"must be a multiple of the engine's KV block size ({block_size} tokens)")
    return chunk_tokens // block_size
