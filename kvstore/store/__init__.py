"""TieredStore, the store's face."""

from kvstore.store.tiered import Lookup, TieredStore

__all__ = ["Lookup", "TieredStore"]
