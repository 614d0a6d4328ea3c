"""Two hosts, one array, on real vLLM engines: host A's engine stores a prompt through its
service; a fresh engine on host B (its own service and host id, reading A's device
through the index) loads it and generates the same tokens. Both engines publish KV
events over ZMQ, and a router listening hears kvstore's chunks with their medium."""

from __future__ import annotations

import json
import os
import threading

import msgspec
import pytest
from support.engines import assert_close, run_engine
from support.services import service_client, stop_service

from bench.support.tiny_model import build_tiny_llama, prompt_token_ids

pytest.importorskip("vllm", reason="needs the vllm extra (pip install -e .[vllm])")
zmq = pytest.importorskip("zmq", reason="vLLM's KV events travel over ZMQ")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CHUNK = 256
PROMPT_LEN = 2049  # 8 full chunks and one token the engine must compute
FULL_CHUNKS = PROMPT_LEN // CHUNK


class KVEventListener:
    """A router's ear: subscribes to an engine's KV event stream and keeps every event
    (vLLM's KVEventBatch frames: topic, sequence number, msgpack [ts, events, rank])."""

    def __init__(self, endpoint: str) -> None:
        self.events: list[dict] = []
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(100):
                _, _, payload = self._socket.recv_multipart()
                self.events += msgspec.msgpack.decode(payload)[1]

    def close(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)
        return self.events


def kvstore_events(events: list[dict], kind: str, medium: str) -> list[dict]:
    return [e for e in events if e.get("type") == kind and e.get("medium") == medium]


def test_host_b_loads_what_host_a_stored_and_routers_hear_both(tmp_path, disk_dir, redis_server):
    model = build_tiny_llama(tmp_path / "model")
    long_prompt = prompt_token_ids(PROMPT_LEN, seed=1)
    prompts = tmp_path / "prompts.json"  # a short second prompt: more steps to publish events in
    prompts.write_text(json.dumps([long_prompt, prompt_token_ids(40, seed=5)]))
    devices = {name: os.path.join(disk_dir, name) for name in ("a", "b")}
    configs = {}
    for name, other in (("a", "b"), ("b", "a")):
        tiers: dict = {"disk": [{"path": devices[name], "capacity": "256MiB"}]}
        if name == "b":
            tiers["dram"] = {"capacity": "256MiB"}  # A writes straight to its device
        configs[name] = {"chunk_tokens": CHUNK, "tiers": tiers,
                         "service": {"socket": str(tmp_path / f"{name}.sock")},
                         "cluster": {"host_id": f"host-{name}", "index_url": redis_server.url,
                                     "index_deadline_s": 2.0,  # a busy 2-core machine's Redis
                                     "peers": [{"host_id": f"host-{other}",
                                                "disk": [{"path": devices[other], "capacity": "256MiB"}]}]}}
    heard = {}
    try:
        for name in ("a", "b"):
            endpoint = f"ipc://{tmp_path}/{name}-events"
            listener = KVEventListener(endpoint)
            try:
                runs = run_engine(model, prompts, {"config": configs[name], "lookup_timeout_s": 30},
                                  kv_events=endpoint).results
            finally:
                heard[name] = listener.close()
            if name == "a":
                stored = runs[0]
                assert stored["num_cached_tokens"] == 0
        loaded = runs[0]
        assert loaded["num_cached_tokens"] == FULL_CHUNKS * CHUNK
        assert_close(stored, loaded, "kvstore, from the peer")
        info = service_client(configs["b"]).info()
        counters = info["counters"]
        assert counters["peer.bytes_read"] >= FULL_CHUNKS * info["chunk_bytes"]  # read from A's device
        assert counters.get("peer.hits", 0) + counters.get("prefetch.chunks", 0) >= FULL_CHUNKS
        assert "disk.hits" not in counters and info["tiers"][1]["chunks"] == 0  # nothing on B's own disk
    finally:
        for config in configs.values():
            stop_service(config)
    # A's chunks went to its device, B's (from A's) into its DRAM; each one BlockStored
    # naming the chunk's 16 engine blocks and its 256 tokens.
    chunks = [long_prompt[i * CHUNK : (i + 1) * CHUNK] for i in range(FULL_CHUNKS)]
    for name, medium in (("a", "kvstore-disk"), ("b", "kvstore-dram")):
        events = kvstore_events(heard[name], "BlockStored", medium)
        assert sorted(chunks.index(e["token_ids"]) for e in events if e["token_ids"] in chunks) == \
            list(range(FULL_CHUNKS)), (name, {e.get("medium") for e in heard[name]})
        assert all(len(e["block_hashes"]) == CHUNK // e["block_size"] for e in events)
