"""vLLM general plugin: makes `"kv_connector": "TieredKVConnector"` work without a module path."""

from __future__ import annotations

CONNECTOR_NAME = "TieredKVConnector"


def register() -> None:
    """Entry point `vllm.general_plugins`; vLLM calls it in every process, maybe twice."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "engine_plugin.connector",
                                              "TieredKVConnector")
