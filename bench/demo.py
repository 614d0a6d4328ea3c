"""`kvstore demo`: the product on a real vLLM engine, in about two minutes on a CPU.

The same long prompts, each run in a fresh engine process (vLLM's own prefix cache
dies with its process, so only kvstore can supply the KV):
  cold        no connector: the reference TTFT and greedy tokens
  cold+save   connector on, nothing stored yet: prefill, then chunks are saved
  dram        a fresh engine; chunks come from the service's DRAM tier
  disk        the service is restarted (DRAM gone); chunks come from disk, O_DIRECT
Each line shows TTFT (p50 over the prompts), how many prompt tokens kvstore
supplied, and whether the generated tokens equal the cold run's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.engine_run import run_fresh
from bench.tiny_model import build_tiny_llama, prompt_token_ids
from kvstore.client import stop_service
from kvstore.config import load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", help="where the model, disk tier and socket go "
                        "(default: a new temporary directory)")
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--single-process", action="store_true",
                        help="run vLLM's scheduler and worker in one process (faster start)")
    parser.add_argument("--json", help="also write the results here")


def demo_config(workdir: Path) -> dict[str, Any]:
    return {"chunk_tokens": 256,
            "tiers": {"host": {"capacity": "1GiB"},
                      "disk": [{"path": str(workdir / "disk"), "capacity": "2GiB"}]},
            "service": {"socket": str(workdir / "kvstore.sock")}}


def run(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvstore-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"kvstore demo in {workdir}: building a tiny random-weight Llama ...", flush=True)
    model = build_tiny_llama(workdir / "model", layers=4, hidden=512, heads=8, kv_heads=4)
    prompts_file = workdir / "prompts.json"
    prompts = [prompt_token_ids(args.prompt_tokens, seed=seed) for seed in range(args.prompts)]
    prompts_file.write_text(json.dumps(prompts))
    config = demo_config(workdir)
    connector = {"config": config}
    max_len = args.prompt_tokens + 64

    def engine(label: str, with_connector: bool) -> dict[str, Any]:
        print(f"  {label}: starting a fresh vLLM engine ...", flush=True)
        run = run_fresh(model, prompts_file, connector if with_connector else None,
                        single_process=args.single_process, max_model_len=max_len)
        return {"mode": label, "results": run.results}

    stop_service(load_config(config))  # a service left from an earlier demo in this workdir
    try:
        runs = [engine("cold", False), engine("cold+save", True), engine("dram", True)]
        stop_service(load_config(config))  # drains DRAM to disk, checkpoints, exits
        runs.append(engine("disk", True))
    finally:
        stop_service(load_config(config))
    rows = _rows(runs)
    _print(rows, args.prompt_tokens)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": rows}, indent=2))
    return 0 if all(row["outputs_match"] for row in rows) else 1


def _rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    reference = [r["token_ids"] for r in runs[0]["results"]]
    cold_ttft = statistics.median(r["ttft_s"] for r in runs[0]["results"])
    rows = []
    for run in runs:
        ttft = statistics.median(r["ttft_s"] for r in run["results"])
        rows.append({"mode": run["mode"], "ttft_p50_s": ttft, "speedup": cold_ttft / ttft,
                     "loaded_tokens": min(r["num_cached_tokens"] for r in run["results"]),
                     "outputs_match": [r["token_ids"] for r in run["results"]] == reference})
    return rows


def _print(rows: list[dict[str, Any]], prompt_tokens: int) -> None:
    print(f"\n{'mode':<10} {'TTFT p50':>10} {'vs cold':>8} {'tokens from kvstore':>20}  outputs match")
    for row in rows:
        print(f"{row['mode']:<10} {row['ttft_p50_s'] * 1000:>8.1f}ms {row['speedup']:>7.2f}x "
              f"{row['loaded_tokens']:>11} of {prompt_tokens:<6}  {row['outputs_match']}")
