"""`engine_plugin.connector`, the module path engines' configs named before each engine had its room:
kept so those configs still load; the code is engine_plugin.vllm.connector
(docs/architecture.md, "Module paths")."""

from engine_plugin.vllm.connector import TieredKVConnector

__all__ = ["TieredKVConnector"]
