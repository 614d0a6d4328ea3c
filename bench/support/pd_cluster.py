"""Prefill/decode disaggregation through kvstore on one machine, behind vLLM's router:
the deployment (PDCluster) and the router's two requests replayed by hand (replay), for
tests/test_vllm_pd.py and the `pd` experiment (bench/lab/pd.py).

PDCluster starts one real redis-server (the cluster index), a prefill OpenAI server
(`kv_producer`, host id `prefill`, its kvstore service writing through to `array/prefill`)
and a decode one (`kv_consumer`, host id `decode`, its service on `array/decode`), each
listing the other's directory as a peer's device, and `vllm-router
--vllm-pd-disaggregation` in front. The router sends each request to the prefill server
with `max_tokens` 1 and `kv_transfer_params` {"do_remote_decode": true, ...}, then the
original request to the decode server with the kv_transfer_params the prefill returned
(seen on the wire; `replay` sends exactly these two requests without the router).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.support.openai_server import Completion, OpenAIServer, complete, completion_body
from bench.support.processes import free_port, paused, wait_healthy
from bench.support.redis_server import RedisServer
from kvstore.config.store import load_config
from kvstore.service.client import attach, service_info, stop_service

SERVER_ARGS = ["--dtype", "float16", "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
               "--max-model-len", "4096", "--enforce-eager"]
CHUNK = 256
ROUTER = "vllm-router"
# What vllm-router 0.1.17 adds to the prefill request (read off the wire; vLLM's NixlConnector
# protocol: a consumer would pull the blocks named in the reply).
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def router_binary() -> str | None:
    """vllm-router next to this interpreter (the venv's), or on PATH."""
    beside = Path(sys.executable).parent / ROUTER
    return str(beside) if beside.exists() else shutil.which(ROUTER)


def router_unavailable() -> str | None:
    if router_binary() is None:
        return "vllm-router is not installed (pip install -e .[pd])"
    return None


class VllmRouter:
    """`vllm-router --vllm-pd-disaggregation` in its own process group."""

    def __init__(self, prefill_url: str, decode_url: str, log_path: Path) -> None:
        binary = router_binary()
        if binary is None:
            raise RuntimeError(router_unavailable())
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.command = [binary, "--vllm-pd-disaggregation", "--prefill", prefill_url, "--decode", decode_url,
                        "--host", "127.0.0.1", "--port", str(self.port), "--policy", "round_robin",
                        "--disable-retries", "--prometheus-port", str(free_port())]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        problem = wait_healthy(self.url, self.process, timeout_s)
        if problem is not None:
            self.stop()
            raise RuntimeError(f"vllm-router {problem}: {self.log_path.read_text(errors='replace')[-3000:]}")

    def stop(self) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)
        self.process = None


def store_configs(workdir: Path, redis_url: str, *, dram: str = "1GiB", disk: str = "2GiB",
                  staging: str = "128MiB") -> dict[str, dict[str, Any]]:
    """The prefill's and the decode's kvstore configs: one shared "array" directory, one
    device (subdirectory) per host, each host listing the other's as a peer's."""
    devices = {name: str(workdir / "array" / name) for name in ("prefill", "decode")}
    (workdir / "array").mkdir(parents=True, exist_ok=True)
    configs = {}
    for name, other in (("prefill", "decode"), ("decode", "prefill")):
        configs[name] = {
            "chunk_tokens": CHUNK,
            "tiers": {"dram": {"capacity": dram}, "disk": [{"path": devices[name], "capacity": disk}]},
            "service": {"socket": str(workdir / f"{name}.sock"), "staging": staging},
            "cluster": {"host_id": name, "index_url": redis_url,
                        "peers": [{"host_id": other, "disk": [{"path": devices[other], "capacity": disk}]}]}}
    configs["prefill"]["write_policy"] = "write_through"  # peers read only its disk tier
    return configs


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request vllm-router sends the prefill server for `body`."""
    return {**body, "max_tokens": 1, "min_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}


def replay(prefill_url: str, decode_url: str, body: dict[str, Any]) -> tuple[Completion, Completion]:
    """The router's two requests, by hand: prefill, then decode with what prefill returned."""
    prefilled = complete(prefill_url, prefill_body(body))
    decoded = complete(decode_url, {**body, "kv_transfer_params": prefilled.kv_transfer_params})
    return prefilled, decoded


class PDCluster:
    """Redis, the prefill and decode servers (started together), and the router if it is
    installed (`router` None otherwise); everything stopped on exit."""

    def __init__(self, model: str | Path, workdir: Path, *, pd_wait_s: float = 5.0, kv_cache_gib: int = 2,
                 with_router: bool = True) -> None:
        self.model = str(model)
        self.workdir = workdir
        self.redis = RedisServer(workdir / "redis")
        (workdir / "redis").mkdir(parents=True, exist_ok=True)
        self.redis.start()
        self.configs = store_configs(workdir, self.redis.url)
        self.prefill = OpenAIServer(model, SERVER_ARGS, workdir / "prefill.log", kv_cache_gib=kv_cache_gib,
                                    kv_role="kv_producer",
                                    connector={"config": self.configs["prefill"], "lookup_timeout_s": 1.0})
        self.decode = OpenAIServer(model, SERVER_ARGS, workdir / "decode.log", kv_cache_gib=kv_cache_gib,
                                   kv_role="kv_consumer",
                                   connector={"config": self.configs["decode"], "pd_wait_s": pd_wait_s})
        self.router: VllmRouter | None = None
        self._with_router = with_router and router_unavailable() is None

    def __enter__(self) -> PDCluster:
        try:
            with ThreadPoolExecutor(2) as pool:
                for started in [pool.submit(server.start) for server in (self.prefill, self.decode)]:
                    started.result()
            if self._with_router:
                self.router = VllmRouter(self.prefill.url, self.decode.url, self.workdir / "router.log")
                self.router.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.router is not None:
            self.router.stop()
        for server in (self.prefill, self.decode):
            server.stop()
        for config in self.configs.values():
            stop_service(load_config(config))
        self.redis.stop()

    def send(self, prompt: list[int], max_tokens: int) -> Completion:
        """One request through the router (or the router's two requests, replayed). Its
        cached_tokens are the decode engine's own count of tokens its connector supplied
        (vLLM's metrics): vllm-router 0.1.17 empties usage.prompt_tokens_details."""
        body = completion_body(self.model, prompt, max_tokens)
        before = self.decode.external_tokens()
        if self.router is not None:
            done = complete(self.router.url, body)
        else:
            done = replay(self.prefill.url, self.decode.url, body)[1]
        return dataclasses.replace(done, cached_tokens=int(self.decode.external_tokens() - before))

    def counters(self, name: str) -> dict[str, int]:
        info = service_info(load_config(self.configs[name])) or {}
        return dict(info.get("counters", {}))

    def decode_info(self) -> dict[str, Any]:
        return service_info(load_config(self.configs["decode"])) or {}

    @contextlib.contextmanager
    def prefill_service_stopped(self) -> Iterator[None]:
        """The prefill's kvstore service paused (SIGSTOP): its saves do not land until resumed."""
        client = attach(load_config(self.configs["prefill"]))
        pid = int(client.info()["service_pid"])
        client.close()
        with paused(pid):
            yield
