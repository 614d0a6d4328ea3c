"""LMCache: the storage plugin (`storage.KVStoreBackend`), the MP server's L2 adapter
(`l2.KVStoreL2Adapter`) and the key scope both keep per model (key_scope.py)."""
