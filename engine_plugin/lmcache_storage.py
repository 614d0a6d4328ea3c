"""`engine_plugin.lmcache_storage`, the module path engines' configs named before each engine had its room:
kept so those configs still load; the code is engine_plugin.lmcache.storage
(docs/architecture.md, "Module paths")."""

from engine_plugin.lmcache.storage import KVStoreBackend

__all__ = ["KVStoreBackend"]
