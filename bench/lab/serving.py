"""Serving measurements against vLLM's OpenAI server: its own benchmark without and with
kvstore, and one long prompt computed in one step, then served again from kvstore.

The client is vLLM's `vllm.benchmarks.serve` (what `vllm bench serve` runs) with its
`prefix_repetition` dataset: `--num-prefixes` shared prefixes, each followed by
`--prompts-per-prefix` distinct suffixes, in shuffled order. The engine's KV cache
(VLLM_CPU_KVCACHE_SPACE, whole GiB) is sized below the prefixes' KV, so vLLM's own
prefix cache evicts prefixes that come back later; with kvstore they come back from
its DRAM tier. Each mode runs in a fresh server (same seed, same requests).

  python -m bench.lab serving [--model DIR] [--prefix-len 1024] [--suffix-len 64]
      [--num-prefixes 12] [--prompts-per-prefix 3] [--output-len 16] [--max-concurrency 2]
      [--kv-cache-gib 1] [--workdir DIR] [--json out.json]

  python -m bench.lab serving --long-prompt 8192 [--gap-s 5] [--kv-cache-gib 6]
      [--share-dram own-user|allowed|off]

--long-prompt N starts one server with kvstore and --max-num-batched-tokens N, sends an
N-token prompt (computed in one step: at 8192, 32 chunks to save at once, four times what
the default 256 MiB save window holds at 32 MiB per chunk), then the same prompt again
--gap-s later (0: the moment the reply arrives), and reports each request's cached tokens
and wall time, the service's save.dropped, and how long the second request was held for
the first one's saves (save_wait.*). --share-dram off loads DRAM hits through the window
(two copies) instead of straight from the shared tier (one). Without --model it builds the Llama-3-8B-geometry
model (bench/support/tiny_model.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.lab import Result
from bench.support.openai_server import OpenAIServer
from bench.support.tiny_model import build_llama3_8b_geometry, prompt_token_ids
from kvstore.config.store import load_config
from kvstore.service.client import service_info, stop_service

SERVER_ARGS = ["--dtype", "float16", "--enforce-eager", "--max-model-len", "4096"]
# vllm.benchmarks.serve has no __main__; this is what `vllm bench serve` calls.
_CLIENT = ("import sys\n"
           "from vllm.benchmarks.serve import add_cli_args, main\n"
           "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
           "parser = FlexibleArgumentParser()\n"
           "add_cli_args(parser)\n"
           "main(parser.parse_args(sys.argv[1:]))\n")
COLUMNS = (("mean_ttft_ms", "TTFT mean ms"), ("median_ttft_ms", "TTFT median ms"),
           ("p99_ttft_ms", "TTFT p99 ms"), ("median_tpot_ms", "TPOT median ms"),
           ("request_throughput", "req/s"),
           ("total_token_throughput", "tok/s (in+out)"))


def client_args(server: OpenAIServer, args: argparse.Namespace, result: Path) -> list[str]:
    return ["--backend", "vllm", "--base-url", server.url, "--model", server.model,
            "--dataset-name", "prefix_repetition", "--seed", "0",
            "--prefix-repetition-prefix-len", str(args.prefix_len),
            "--prefix-repetition-suffix-len", str(args.suffix_len),
            "--prefix-repetition-num-prefixes", str(args.num_prefixes),
            "--prefix-repetition-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prefixes * args.prompts_per_prefix),
            "--max-concurrency", str(args.max_concurrency), "--request-rate", "inf",
            "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]


def both_modes(args: argparse.Namespace, workdir: Path) -> dict[str, dict[str, Any]]:
    """Both modes, each in a fresh server; {mode: vLLM's result dict}."""
    model = args.model or str(build_llama3_8b_geometry(workdir / "model-8b"))
    store = {"chunk_tokens": 256, "tiers": {"dram": {"capacity": args.dram_capacity}},
             "service": {"socket": str(workdir / "kvstore.sock")}}
    results: dict[str, dict[str, Any]] = {}
    try:
        modes = (("vLLM prefix cache", None), ("vLLM prefix cache + kvstore", {"config": store}))
        for mode, connector in modes:
            slug = "kvstore" if connector else "vllm"
            with OpenAIServer(model, SERVER_ARGS, workdir / f"server-{slug}.log", connector=connector,
                              kv_cache_gib=args.kv_cache_gib) as server:
                result = workdir / f"result-{slug}.json"
                subprocess.run([sys.executable, "-c", _CLIENT, *client_args(server, args, result)],
                               check=True, timeout=args.timeout_s, cwd=workdir)
                results[mode] = json.loads(result.read_text())
    finally:
        stop_service(load_config(store))
    return results


def long_prompt(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One N-token prompt computed in one step, then sent again --gap-s later."""
    model = args.model or str(build_llama3_8b_geometry(workdir / "model-8b"))
    store = {"chunk_tokens": 256, "tiers": {"dram": {"capacity": args.dram_capacity}},
             "service": {"socket": str(workdir / "kvstore.sock"), "share_dram": args.share_dram}}
    tokens = args.long_prompt
    server_args = ["--dtype", "float16", "--enforce-eager", "--no-enable-prefix-caching",
                   "--enable-prompt-tokens-details", "--max-model-len", str(tokens + 256),
                   "--max-num-batched-tokens", str(tokens)]
    prompt = prompt_token_ids(tokens, seed=3)
    try:
        with OpenAIServer(model, server_args, workdir / "server-long.log", connector={"config": store},
                          kv_cache_gib=args.kv_cache_gib) as server:
            first = server.complete(prompt, max_tokens=1, timeout_s=args.timeout_s)
            time.sleep(args.gap_s)
            second = server.complete(prompt, max_tokens=1, timeout_s=args.timeout_s)
        counters = (service_info(load_config(store)) or {}).get("counters", {})
    finally:
        stop_service(load_config(store))
    return {"prompt_tokens": tokens, "gap_s": args.gap_s, "share_dram": args.share_dram,
            "first_cached": first.cached_tokens,
            "first_s": first.seconds, "second_cached": second.cached_tokens, "second_s": second.seconds,
            "save_dropped": counters.get("save.dropped", 0),
            "save_wait_requests": counters.get("save_wait.requests", 0),
            "save_wait_ms": counters.get("save_wait.ms", 0)}


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| mode | " + " | ".join(label for _, label in COLUMNS) + " |",
             "| --- |" + " ---: |" * len(COLUMNS)]
    for mode, result in results.items():
        lines.append(f"| {mode} | " + " | ".join(f"{result[key]:.2f}" for key, _ in COLUMNS) + " |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: build the 8B-geometry one)")
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--num-prefixes", type=int, default=12)
    parser.add_argument("--prompts-per-prefix", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--max-concurrency", type=int, default=2)
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--dram-capacity", default="4GiB", help="kvstore's DRAM tier")
    parser.add_argument("--timeout-s", type=float, default=1800, help="deadline of each client run")
    parser.add_argument("--long-prompt", type=int, help="measure one N-token prompt instead (see above)")
    parser.add_argument("--gap-s", type=float, default=5.0, help="--long-prompt: seconds between the two")
    parser.add_argument("--share-dram", choices=("own-user", "allowed", "off"), default="own-user",
                        help="--long-prompt: service.share_dram (off: DRAM hits copied through the "
                             "window, the path before one-copy loads)")


def experiment(args: argparse.Namespace, workdir: Path) -> Result:
    if args.long_prompt:
        measured = long_prompt(args, workdir)
        return Result(json.dumps(measured, indent=2), measured)
    results = both_modes(args, workdir)
    return Result(table(results), results)
