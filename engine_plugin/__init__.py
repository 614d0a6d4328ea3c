"""The only code that imports an engine, a room per engine: vllm/ (the KV connector, its
engine-free core in vllm/core/, the secondary tier of vLLM's own offloading), sglang/
(HiCache's storage backend) and lmcache/ (the storage plugin and the MP server's L2
adapter). The modules at this level only keep the module paths that engines' configs
named before the rooms (docs/architecture.md, "Module paths")."""
