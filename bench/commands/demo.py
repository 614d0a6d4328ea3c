"""`kvstore demo`: a real conversation served three ways, on vLLM's OpenAI server.

The model is a real chat model (SmolLM2-135M-Instruct, bench/support/chat_model.py, built once
from its PyPI wheel). The same four-turn conversation, each turn sent the moment the
previous answer arrives, is served by:
  recompute   a server without kvstore (the reference answers and TTFT)
  dram        a server with kvstore: each turn loads the previous turn's prompt and
              answer, which the previous turn saved, from the DRAM tier
  disk        both restarted (DRAM gone): every turn, the first included, loads from disk
Each server is warmed with an unrelated question first, so no turn pays the engine's
warm-up. The history each server sees is the reference's, so prompts are equal. Answers
are judged as vLLM's own tests judge them (bench/support/answers.py): the same greedy tokens, or
a near-tie at the first difference (each side's token in the other's top 5 logprobs);
the demo prints where and by how much. The dram and disk runs of a turn that loaded the
same chunks must agree to the bit (tokens and logprobs). It exits 1 on a divergence, on
two loads of the same chunks that differ, or on a turn that loaded less than its bound.
It runs float16, and bfloat16 too on CPUs with AMX (bench/support/cpu_dtypes.py). `--tiny` runs
the older single-prompt demo on a random-weight model (`kvstore ttft` at one context length).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.commands.ttft import demo_model, measure, print_rows
from bench.support.answers import Comparison, compare, identical
from bench.support.chat_model import ChatModelError, build_chat_model, default_chat_model_dir
from bench.support.conversation import QUESTIONS, Turn, converse
from bench.support.cpu_dtypes import checked_dtypes
from bench.support.openai_server import OpenAIServer, chat
from bench.support.runs import CHUNK, default_config, run_workdir, server_args
from kvstore.config.store import load_config
from kvstore.service.client import stop_service


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
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], help="serve in this dtype only "
                        "(default: float16, and bfloat16 too on a CPU with AMX)")
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
        good, results = True, {}
        for dtype in [args.dtype] if args.dtype else checked_dtypes():
            runs = _serve_three_ways(model, workdir, args.max_tokens, dtype)
            _print_conversation(runs, dtype)
            good = _judge(runs) and good
            results[dtype] = {mode: [vars(turn) for turn in turns] for mode, turns in runs.items()}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if good else 1


def _serve_three_ways(model: Path, workdir: Path, max_tokens: int, dtype: str) -> dict[str, list[Turn]]:
    config = default_config(workdir, "1GiB")
    store = load_config(config)
    stop_service(store)
    runs: dict[str, list[Turn]] = {}
    for mode in ("recompute", "dram", "disk"):
        with_kvstore = " with kvstore" if mode != "recompute" else ""
        print(f"{dtype}, {mode}: starting vLLM's OpenAI server{with_kvstore} ...", flush=True)
        connector = None if mode == "recompute" else {"config": config}
        with OpenAIServer(model, server_args(dtype), workdir / f"{mode}-{dtype}.log", connector=connector,
                          kv_cache_gib=2) as server:
            chat(server.url, "chat", [{"role": "user", "content": "Say hello."}], 8)  # warm-up
            reference = runs.get("recompute")
            runs[mode] = converse(server.url, "chat", QUESTIONS, max_tokens=max_tokens, chunk_tokens=CHUNK,
                                  answers=[t.answer for t in reference] if reference else None)
        if mode == "dram":
            stop_service(store)  # DRAM written down and gone: the next server reads the disk
    stop_service(store)
    return runs


def _print_conversation(runs: dict[str, list[Turn]], dtype: str) -> None:
    for i, turn in enumerate(runs["recompute"], start=1):
        print(f"\nturn {i}, user: {turn.question}\nassistant: {turn.answer.strip()}")
    print(f"\n{dtype}:\n{'turn':>4} {'prompt':>7} {'cached (dram)':>13} {'bound':>6} {'cached (disk)':>13} "
          f"{'TTFT recompute':>15} {'TTFT dram':>10} {'TTFT disk':>10}  answers vs recompute")
    for i, (cold, dram, disk) in enumerate(zip(runs["recompute"], runs["dram"], runs["disk"], strict=True)):
        print(f"{i + 1:>4} {cold.prompt_tokens:>7} {dram.cached_tokens:>13} {dram.bound:>6} "
              f"{disk.cached_tokens:>13} {cold.ttft_s * 1000:>13.0f}ms {dram.ttft_s * 1000:>8.0f}ms "
              f"{disk.ttft_s * 1000:>8.0f}ms  {_cell(_comparisons(runs, i))}")


def _comparisons(runs: dict[str, list[Turn]], turn: int) -> list[Comparison]:
    return [compare(runs["recompute"][turn], runs[mode][turn], ("recompute", mode))
            for mode in ("dram", "disk")]


def _cell(comparisons: list[Comparison]) -> str:
    if all(c.equal for c in comparisons):
        return "equal"
    return ", ".join(f"{c.names[1]}: {c.verdict}" for c in comparisons)


def _judge(runs: dict[str, list[Turn]]) -> bool:
    """Prints how the answers compared; True where every answer is close to the recompute's
    (vLLM's bar), every two loads of the same chunks agree to the bit and every turn
    loaded its bound."""
    good, notes = True, []
    for i, (dram, disk) in enumerate(zip(runs["dram"], runs["disk"], strict=True)):
        for comparison in _comparisons(runs, i):
            good = good and comparison.close
            if not comparison.equal:
                notes.append(f"turn {i + 1}: {comparison.describe()}")
        if i and dram.cached_tokens == disk.cached_tokens > 0 and not identical(dram, disk):
            good = False
            notes.append(f"turn {i + 1}: dram and disk loaded the same {dram.cached_tokens} tokens of the "
                         "same chunks but answered differently (tokens or logprobs): wrong KV")
        for mode, turn in (("dram", dram), ("disk", disk)):
            if turn.cached_tokens < turn.bound:
                good = False
                notes.append(f"turn {i + 1}: {mode} loaded {turn.cached_tokens} tokens of a "
                             f"{turn.bound}-token bound")
    for note in notes:
        print(note)
    print("answers: " + ("as vLLM's tests require (equal, or a near-tie at the first difference)"
                         if good else "FAILED (see above)"))
    return good


def _run_tiny(args: argparse.Namespace, workdir: Path) -> int:
    print(f"kvstore demo in {workdir}: building a tiny random-weight Llama ...", flush=True)
    rows: list[dict[str, Any]] = [
        row for dtype in ([args.dtype] if args.dtype else checked_dtypes())
        for row in measure(demo_model(workdir), workdir, [args.prompt_tokens], ["recompute", "dram", "disk"],
                           args.prompts, default_config(workdir, "1GiB"),
                           progress=lambda text: print(text, flush=True), dtype=dtype)]
    print_rows(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": rows}, indent=2))
    return 0 if all(row["answers_close"] for row in rows) else 1
