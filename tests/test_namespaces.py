"""The announced namespaces stay bounded whoever floods them.

Each distinct cache salt of an HTTP request makes a vLLM engine make and announce new
namespaces. Replayed here: an engine that forgets salts it has not used lately."""

from __future__ import annotations

import tracemalloc

from engine_plugin.namespaces import MAX_SALTS, EngineNamespaces
from kvstore.format.keys import KVNamespace, Weights
from kvstore.service import protocol as P

MODEL = KVNamespace("meta-llama/Llama-3.1-8B-Instruct", "bfloat16",
                    "cpu/kv:auto/FullAttentionSpec:L32:b16:h8:d128", 16,
                    weights=Weights("xxh3:0123456789abcdef"))


def test_an_engine_keeps_the_namespaces_of_recent_salts_only():
    """An HTTP user sending a new cache salt with every request costs the engine a bounded
    memory; a salt used again after it was forgotten is announced again."""
    engine = EngineNamespaces(MODEL, ["full", "sliding"], 2)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(20 * MAX_SALTS):
        engine(f"user-{i}")
    grown = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    assert grown < 8 * 1024 * MAX_SALTS  # 2 MiB here (four namespaces a salt); 30 MiB without a bound
    pending = engine.unannounced(1 << 30)
    assert len(pending) == 4 * MAX_SALTS and len(engine.unannounced(P.MAX_ANNOUNCED)) == P.MAX_ANNOUNCED
    engine.announced(pending)
    assert engine.unannounced(1) == []
    assert engine("user-0") == engine("user-0") and len(engine.unannounced(10)) == 4  # forgotten: again
