"""The connector's configuration: a kvstore config plus a few engine-side options.

An engine passes one mapping (vLLM: `kv_connector_extra_config`). Its `config` key
names a kvstore YAML/JSON file or holds the config inline; without `config`, the
store keys may sit at the top level. Engine-side keys:
  load_async: true   read chunks while the request waits, outside the batch
  prefetch:   true   a request's arrival starts promoting its stored chunks to DRAM
  prefetch_policy: wait        best_effort | wait | timeout (connectors/prefetch.py)
  prefetch_max_wait_s: 10      the longest a request is held for its prefetch
  prefetch_timeout_s_per_1k_tokens: 0.05   the `timeout` policy's budget per 1k tokens
  device_staging: 0  bytes of device memory (HBM; CPU memory on the CPU engine) for
                     chunks staged ahead of loads; 0: off (connectors/device_staging.py)
  model_id:   str    identity used in chunk keys (default: the engine's model path)
  lookup_timeout_s: 1        deadline of one scheduler lookup (it blocks the scheduler)
  wait_for_saves_s: 5        the longest a request is held while its prefix is being saved
  save_window_wait_s: 2      the longest one step waits for free save window slots
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from connectors.prefetch import PrefetchPolicy
from kvstore.config import StoreConfig, load_config
from kvstore.errors import ConfigError
from kvstore.fields import size_field

_ENGINE_KEYS = {"load_async", "model_id", "prefetch", "prefetch_policy", "prefetch_max_wait_s",
                "prefetch_timeout_s_per_1k_tokens", "device_staging", "lookup_timeout_s",
                "wait_for_saves_s", "save_window_wait_s"}


@dataclass(frozen=True)
class ConnectorOptions:
    store: StoreConfig
    load_async: bool = True
    model_id: str | None = None
    prefetch: PrefetchPolicy | None = field(default_factory=PrefetchPolicy)  # None: prefetch off
    device_staging: int = 0  # bytes of the workers' device staging pools; 0: off
    lookup_timeout_s: float = 1.0
    wait_for_saves_s: float = 5.0
    save_window_wait_s: float = 2.0


def parse_options(extra: dict[str, Any] | None) -> ConnectorOptions:
    extra = dict(extra or {})
    policy = PrefetchPolicy(name=extra.pop("prefetch_policy", "wait"),
                            max_wait_s=extra.pop("prefetch_max_wait_s", 10.0),
                            timeout_s_per_1k_tokens=extra.pop("prefetch_timeout_s_per_1k_tokens", 0.05))
    load_async, prefetch = extra.pop("load_async", True), extra.pop("prefetch", True)
    device_staging = size_field("device_staging", extra.pop("device_staging", 0), minimum=0)
    waits = {name: extra.pop(name, default) for name, default in (
        ("lookup_timeout_s", 1.0), ("wait_for_saves_s", 5.0), ("save_window_wait_s", 2.0))}
    for name, value in waits.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError(name, value, "must be a number of seconds >= 0")
    if waits["lookup_timeout_s"] <= 0:
        raise ConfigError("lookup_timeout_s", waits["lookup_timeout_s"], "must be > 0")
    for name, value in (("load_async", load_async), ("prefetch", prefetch)):
        if not isinstance(value, bool):
            raise ConfigError(name, value, "must be true or false")
    model_id = extra.pop("model_id", None)
    if model_id is not None and (not isinstance(model_id, str) or not model_id):
        raise ConfigError("model_id", model_id, "must be a non-empty string")
    if "config" in extra:
        source = extra.pop("config")
        if extra:
            raise ConfigError(next(iter(extra)), extra[next(iter(extra))],
                              f"unknown key next to 'config' (allowed: config, "
                              f"{', '.join(sorted(_ENGINE_KEYS))})")
    else:
        source = extra
    if not source:
        raise ConfigError("config", None, "required: a kvstore config file or mapping")
    return ConnectorOptions(store=load_config(source), load_async=load_async, model_id=model_id,
                            prefetch=policy if prefetch else None, device_staging=device_staging,
                            **waits)


def check_chunk_size(chunk_tokens: int, block_size: int) -> int:
    """Blocks per chunk; a chunk must cover whole engine blocks (a load fills blocks)."""
    if chunk_tokens % block_size:
        raise ConfigError("chunk_tokens", chunk_tokens,
                          f"must be a multiple of the engine's KV block size ({block_size} tokens)")
    return chunk_tokens // block_size
