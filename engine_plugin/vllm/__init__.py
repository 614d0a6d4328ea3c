"""vLLM: the KV connector (`connector.TieredKVConnector`, its scheduler half in
scheduler_role.py), its plugin entry point, the secondary tier of vLLM's own offloading
(`tier.KVStoreTier`), and core/, the connector's logic that imports no engine."""
