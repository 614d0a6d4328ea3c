"""`engine_plugin.vllm_tier`, the module path engines' configs named before each engine had its room:
kept so those configs still load; the code is engine_plugin.vllm.tier
(docs/architecture.md, "Module paths")."""

from engine_plugin.vllm.tier import KVStoreTier

__all__ = ["KVStoreTier"]
