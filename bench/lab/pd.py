"""Prefill/decode disaggregation against one server doing both, on the PDCluster of
bench/support/pd_cluster.py.

  python -m bench.lab pd [--model DIR] [--lengths 2100,2400,2700] [--max-tokens 32]
      [--pd-wait-s 5] [--workdir DIR] [--json out.json]

For each prompt length, three distinct prompts: one per mode (`single`: one server with
no connector computing everything; `pd`: through the router; `pd, prefill lost`: the
same with the prefill's kvstore service stopped (SIGSTOP), so its saves never land and
the decode waits pd_wait_s, then recomputes). Each prompt is sent with max_tokens 1
(time to first token, as the client sees it) and, as another prompt of the same length,
with --max-tokens (end to end). Reported: both times, the decode's cached tokens, and the
decode service's handoff counters. Without --model it builds the Llama-3-8B-geometry model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.lab import Result
from bench.support.openai_server import Completion, OpenAIServer
from bench.support.pd_cluster import SERVER_ARGS, PDCluster
from bench.support.tiny_model import build_llama3_8b_geometry, prompt_token_ids


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: build the 8B-geometry one)")
    parser.add_argument("--lengths", default="2100,2400,2700", help="prompt lengths in tokens")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens the end-to-end requests generate")
    parser.add_argument("--pd-wait-s", type=float, default=5.0, help="the decode's pd_wait_s")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE of each server")


def _row(mode: str, length: int, ttft: Completion, e2e: Completion) -> dict[str, Any]:
    return {"mode": mode, "prompt_tokens": length, "ttft_s": round(ttft.seconds, 3),
            "e2e_s": round(e2e.seconds, 3), "cached_tokens": ttft.cached_tokens,
            "cached_tokens_e2e": e2e.cached_tokens}


def experiment(args: argparse.Namespace, workdir: Path) -> Result:
    model = args.model or str(build_llama3_8b_geometry(workdir / "model-8b"))
    lengths = [int(n) for n in args.lengths.split(",")]
    prompts = {(mode, n, kind): prompt_token_ids(n, seed=1000 + 10 * i + j * 3 + k)
               for i, n in enumerate(lengths) for j, mode in enumerate(("single", "pd", "lost"))
               for k, kind in enumerate(("ttft", "e2e"))}
    rows = []
    with OpenAIServer(model, SERVER_ARGS, workdir / "single.log", kv_cache_gib=args.kv_cache_gib) as single:
        single.complete(prompt_token_ids(300, seed=7), max_tokens=2)  # warm up
        for n in lengths:
            rows.append(_row("single server", n, single.complete(prompts["single", n, "ttft"], 1),
                             single.complete(prompts["single", n, "e2e"], args.max_tokens)))
    with PDCluster(model, workdir / "pd", pd_wait_s=args.pd_wait_s, kv_cache_gib=args.kv_cache_gib) as pd:
        pd.send(prompt_token_ids(300, seed=7), max_tokens=2)  # warm up
        for n in lengths:
            rows.append(_row("pd (router)" if pd.router else "pd (replayed)", n,
                             pd.send(prompts["pd", n, "ttft"], 1),
                             pd.send(prompts["pd", n, "e2e"], args.max_tokens)))
        handoff = {k: v for k, v in pd.counters("decode").items() if k.startswith(("handoff.", "peer."))}
        for n in lengths:
            with pd.prefill_service_stopped():
                rows.append(_row("pd, prefill lost", n, pd.send(prompts["lost", n, "ttft"], 1),
                                 pd.send(prompts["lost", n, "e2e"], args.max_tokens)))
    result = {"rows": rows, "decode_counters_pd": handoff, "pd_wait_s": args.pd_wait_s,
              "max_tokens": args.max_tokens}
    return Result(table(result), result)


def table(result: dict[str, Any]) -> str:
    lines = ["| mode | prompt tokens | TTFT s | end to end s | decode cached tokens |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for row in result["rows"]:
        lines.append(f"| {row['mode']} | {row['prompt_tokens']:,} | {row['ttft_s']:.2f} | "
                     f"{row['e2e_s']:.2f} | {row['cached_tokens']:,} / {row['cached_tokens_e2e']:,} |")
    return "\n".join(lines) + "\n\ndecode service (pd rows): " + json.dumps(result["decode_counters_pd"])
