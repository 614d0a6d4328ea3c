"""kvstore: tiered, content-addressed KV-cache storage for LLM inference engines."""

from kvstore.config.store import StoreConfig, load_config
from kvstore.format.keys import KVNamespace, Shard, TensorParallel, Weights, chunk_keys

__all__ = ["KVNamespace", "Shard", "StoreConfig", "TensorParallel", "Weights", "chunk_keys", "load_config"]
