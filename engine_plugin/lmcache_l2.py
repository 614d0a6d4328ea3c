"""`engine_plugin.lmcache_l2`, the module path engines' configs named before each engine had its room:
kept so those configs still load; the code is engine_plugin.lmcache.l2
(docs/architecture.md, "Module paths")."""

from engine_plugin.lmcache.l2 import KVStoreL2Adapter, KVStoreL2AdapterConfig

__all__ = ["KVStoreL2Adapter", "KVStoreL2AdapterConfig"]
