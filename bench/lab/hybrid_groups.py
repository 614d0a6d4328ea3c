"""Bytes per token stored and read, and TTFT of a load, for the Gemma-3-style hybrid model.

  python -m bench.lab hybrid_groups [--tree DIR]

Runs the engine runner of the checkout at DIR (default: this one) in fresh
engines: one storing two 2,049-token prompts, then three loading them (the first prompt
warms the engine up; figures are the second's), against a DRAM tier of its own service.
A checkout from before SupportsHMA gives the one-group mode (vLLM's hybrid KV cache
manager off); this one keeps the groups (docs/vllm.md, "Hybrid attention").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.lab import Result

PROMPT_TOKENS = 2049


def measure(tree: Path, workdir: Path, loads: int = 3) -> dict[str, Any]:
    sys.path.insert(0, str(tree))  # that checkout's kvstore: the service its engines start
    from bench.support.engine_run import run_fresh
    from bench.support.tiny_model import build_tiny_gemma3, prompt_token_ids
    from kvstore.config.store import load_config
    from kvstore.service.client import attach, stop_service

    model = str(build_tiny_gemma3(workdir / "gemma"))
    prompts = workdir / "prompts.json"
    prompts.write_text(json.dumps([prompt_token_ids(PROMPT_TOKENS, seed=5),
                                   prompt_token_ids(PROMPT_TOKENS, seed=21)]))
    raw = {"chunk_tokens": 256, "tiers": {"dram": {"capacity": "256MiB"}},
           "service": {"socket": str(workdir / "kvstore.sock")}}
    config = load_config(raw)

    def info() -> dict[str, Any]:
        client = attach(config)
        try:
            return client.info()
        finally:
            client.close()

    stored_tokens = 2 * (PROMPT_TOKENS // 256) * 256
    try:
        stored = run_fresh(model, prompts, {"config": raw}, single_process=True, timeout_s=300,
                           dtype="float32", checkout=tree)
        state = info()
        dram = state["tiers"][0]
        result: dict[str, Any] = {
            "hybrid_manager": "off" if "Turning off hybrid kv cache manager" in stored.output else "on",
            "stored_chunks": dram["chunks"],
            "stored_bytes_per_token": dram["chunks"] * state["chunk_bytes"] / stored_tokens,
            "cold_ttft_ms": stored.results[1]["ttft_s"] * 1000, "loads": []}
        for _ in range(loads):
            before = info()["counters"].get("dram.bytes_read", 0)
            loaded = run_fresh(model, prompts, {"config": raw}, single_process=True, timeout_s=300,
                               dtype="float32", checkout=tree)
            read = info()["counters"].get("dram.bytes_read", 0) - before
            second = loaded.results[1]
            result["loads"].append({"cached_tokens": second["num_cached_tokens"], "read_bytes_per_token":
                                    read / stored_tokens, "ttft_ms": second["ttft_s"] * 1000,
                                    "same_tokens": second["token_ids"] == stored.results[1]["token_ids"]})
        return result
    finally:
        stop_service(config)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[2],
                        help="the checkout whose engine runner and connector run (default: this one)")


def experiment(args: argparse.Namespace, workdir: Path) -> Result:
    result = measure(args.tree.resolve(), workdir)
    return Result(json.dumps(result, indent=1), result)
