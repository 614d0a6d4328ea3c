"""`kvstore demo`: a real conversation served three ways, on vLLM's OpenAI server.

The model is a real chat model (SmolLM2-135M-Instruct, bench/chat_model.py, built once
from its PyPI wheel). The same four-turn conversation, each turn sent the moment the
previous answer arrives, is served by:
  recompute   a server without kvstore (the reference answers and TTFT)
  dram        a server with kvstore: each turn loads the previous turn's prompt and
              answer, which the previous turn saved, from the DRAM tier
  disk        both restarted (DRAM gone): every turn, the first included, loads from disk
Each server is warmed with an unrelated question first, so no turn pays the engine's
warm-up. The history each server sees is the reference's, so prompts are equal and the
answers must match. `--tiny` runs the older single-prompt demo on a random-weight model
(`kvstore ttft` at one context length).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.chat_model import ChatModelError, build_chat_model, default_chat_model_dir
from bench.conversation import QUESTIONS, Turn, converse
from bench.openai_server import OpenAIServer, chat
from bench.ttft import default_config, demo_model, measure, print_rows, run_workdir
from kvstore.config.store import load_config
from kvstore.service.client import stop_service

CHUNK = 256
SERVER_ARGS = ["--dtype", "float16", "--enable-prompt-tokens-details", "--max-model-len", "8192",
               "--enforce-eager", "--no-enable-prefix-caching", "--served-model-name", "chat"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", help="where the disk tier, socket and logs go, kept "
                        "(default: a temporary directory, removed at the end)")
    parser.add_argument("--model", help="a chat model directory (default: SmolLM2-135M-Instruct, "
                        "built once into the model cache)")
    parser.add_argument("--max-tokens", type=int, default=200, help="answer length cap per turn")
    parser.add_argument("--tiny", action="store_true", help="the single-prompt demo on a tiny "
                        "random-weight model (no chat model needed)")
    parser.add_argument("--prompt-tokens", type=int, default=4000, help="with --tiny")
    parser.add_argument("--prompts", type=int, default=3, help="with --tiny")
    parser.add_argument("--json", help="also write the results here")


def run(args: argparse.Namespace) -> int:
    with run_workdir(args.workdir, "kvstore-demo-") as workdir:
        if args.tiny:
            return _run_tiny(args, workdir)
        try:
            model = Path(args.model) if args.model else build_chat_model(default_chat_model_dir())
        except ChatModelError as exc:
            print(f"kvstore demo: {exc}\n(`kvstore demo --tiny` needs no chat model)")
            return 2
        runs = _serve_three_ways(model, workdir, args.max_tokens)
    _print_conversation(runs)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {mode: [vars(turn) for turn in turns] for mode, turns in runs.items()}, indent=2))
    return 0 if _answers_match(runs) else 1


def _serve_three_ways(model: Path, workdir: Path, max_tokens: int) -> dict[str, list[Turn]]:
    config = default_config(workdir, "1GiB")
    store = load_config(config)
    stop_service(store)
    runs: dict[str, list[Turn]] = {}
    for mode in ("recompute", "dram", "disk"):
        print(f"{mode}: starting vLLM's OpenAI server{' with kvstore' if mode != 'recompute' else ''} ...",
              flush=True)
        connector = None if mode == "recompute" else {"config": config}
        with OpenAIServer(model, SERVER_ARGS, workdir / f"{mode}.log", connector=connector,
                          kv_cache_gib=2) as server:
            chat(server.url, "chat", [{"role": "user", "content": "Say hello."}], 8)  # warm-up
            reference = runs.get("recompute")
            runs[mode] = converse(server.url, "chat", QUESTIONS, max_tokens=max_tokens, chunk_tokens=CHUNK,
                                  answers=[t.answer for t in reference] if reference else None)
        if mode == "dram":
            stop_service(store)  # DRAM written down and gone: the next server reads the disk
    stop_service(store)
    return runs


def _print_conversation(runs: dict[str, list[Turn]]) -> None:
    for i, turn in enumerate(runs["recompute"], start=1):
        print(f"\nturn {i}, user: {turn.question}\nassistant: {turn.answer.strip()}")
    print(f"\n{'turn':>4} {'prompt':>7} {'cached (dram)':>13} {'bound':>6} {'cached (disk)':>13} "
          f"{'TTFT recompute':>15} {'TTFT dram':>10} {'TTFT disk':>10}  answers match")
    for i, (cold, dram, disk) in enumerate(zip(runs["recompute"], runs["dram"], runs["disk"], strict=True)):
        match = cold.answer == dram.answer == disk.answer
        print(f"{i + 1:>4} {cold.prompt_tokens:>7} {dram.cached_tokens:>13} {dram.bound:>6} "
              f"{disk.cached_tokens:>13} {cold.ttft_s * 1000:>13.0f}ms {dram.ttft_s * 1000:>8.0f}ms "
              f"{disk.ttft_s * 1000:>8.0f}ms  {match}")


def _answers_match(runs: dict[str, list[Turn]]) -> bool:
    answers = [[t.answer for t in turns] for turns in runs.values()]
    return all(a == answers[0] for a in answers)


def _run_tiny(args: argparse.Namespace, workdir: Path) -> int:
    print(f"kvstore demo in {workdir}: building a tiny random-weight Llama ...", flush=True)
    rows: list[dict[str, Any]] = measure(demo_model(workdir), workdir, [args.prompt_tokens],
                                         ["recompute", "dram", "disk"], args.prompts,
                                         default_config(workdir, "1GiB"),
                                         progress=lambda text: print(text, flush=True))
    print_rows(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": rows}, indent=2))
    return 0 if all(row["outputs_match"] for row in rows) else 1
