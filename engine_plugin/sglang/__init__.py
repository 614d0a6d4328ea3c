"""SGLang: HiCache's storage backend (`hicache.KVStoreHiCache`) and hybrid models' extra
host pools (pools.py)."""
