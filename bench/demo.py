"""`kvstore demo`: the product on a real vLLM engine, in a few minutes on a CPU.

The same long prompts served cold (no connector), then with kvstore saving, then
from kvstore's DRAM tier, then from its disk tier after a service restart, each
in a fresh vLLM engine process: `kvstore ttft` at one context length.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.ttft import default_config, demo_model, measure, print_rows, run_workdir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", help="where the model, disk tier and socket go, kept "
                        "(default: a temporary directory, removed at the end)")
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--single-process", action="store_true",
                        help="run vLLM's scheduler and worker in one process (faster start)")
    parser.add_argument("--json", help="also write the results here")


def run(args: argparse.Namespace) -> int:
    with run_workdir(args.workdir, "kvstore-demo-") as workdir:
        print(f"kvstore demo in {workdir}: building a tiny random-weight Llama ...", flush=True)
        model = demo_model(workdir)
        rows = measure(model, workdir, [args.prompt_tokens], ["recompute", "dram", "disk"],
                       args.prompts, default_config(workdir, "1GiB"), args.single_process,
                       progress=lambda text: print(text, flush=True))
    print_rows(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": rows}, indent=2))
    return 0 if all(row["outputs_match"] for row in rows) else 1
