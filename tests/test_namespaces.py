"""The announced namespaces stay bounded whoever floods them, and no reply's size ends a
connection.

Each distinct cache salt of an HTTP request makes a vLLM engine make and announce new
namespaces. Replayed here: an engine that forgets salts it has not used lately; and a
reply over the frame limit answered as an error on a connection that goes on serving."""

from __future__ import annotations

import tracemalloc

import pytest
from support.services import service_config, stop_service
from support.stores import CHUNK_BYTES, make_keys, make_payloads

from engine_plugin.namespaces import MAX_SALTS, EngineNamespaces
from kvstore.config.store import load_config
from kvstore.format.errors import KVStoreError
from kvstore.format.keys import KVNamespace, Weights
from kvstore.format.record import record_bytes
from kvstore.service import protocol as P
from kvstore.service.client import StoreClient

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


# -- a reply too large to send -------------------------------------------------------------


def test_a_reply_over_the_frame_limit_is_an_error_and_the_connection_serves_on(tmp_path):
    """Info's counters grown past the frame limit (a client may add counters of any name
    its pattern allows): the reply is refused with an error, counted, and the same
    connection serves a round trip after it."""
    raw = service_config(tmp_path, host=4 * record_bytes(CHUNK_BYTES), socket="run/kvstore.sock")
    client = StoreClient(load_config(raw), CHUNK_BYTES)
    try:
        for first in range(0, 110_000, 256):
            client.count({f"prefetch.{_letters(n)}": 1.0 for n in range(first, first + 256)})
        with pytest.raises(KVStoreError, match=r"the reply to Info was not sent: .*over the"):
            client.info()
        keys, payloads = make_keys(2, seed=3), make_payloads(2, seed=3)
        for i, payload in enumerate(payloads):
            client.slot(i)[:] = payload.tobytes()
        assert client.put(keys, [0, 1]) == [True, True]
        assert client.get(keys, [1, 0]) == [True, True] and bytes(client.slot(0)) == payloads[1].tobytes()
    finally:
        client.close()
        stop_service(raw)
    log = (tmp_path / "run" / "kvstore.sock.log").read_text()
    assert "counted as malformed.reply" in log and "Traceback" not in log


def _letters(n: int) -> str:
    """`n` as 32 lowercase letters (a counter name the service accepts)."""
    return "".join(chr(97 + (n >> (4 * i)) % 16) for i in range(32))
