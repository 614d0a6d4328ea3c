"""`engine_plugin.sglang_hicache`, the module path engines' configs named before each engine had its room:
kept so those configs still load; the code is engine_plugin.sglang.hicache
(docs/architecture.md, "Module paths")."""

from engine_plugin.sglang.hicache import KVStoreHiCache

__all__ = ["KVStoreHiCache"]
