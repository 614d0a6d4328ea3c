"""Multi-turn chat serving benchmark: several conversations at once over /v1/chat/completions,
without and with kvstore, on the real chat model.

    python -m bench.lab chat_bench [--conversations 3] [--think-s 0] [--max-tokens 200] [--json out.json]

Each conversation has its own system prompt and questions (bench/support/conversation.py's,
varied), runs its turns in order with `--think-s` between a reply and the next question
(0: agent style, the follow-up goes out the moment the reply arrives), and runs at the
same time as the others. Per turn index it prints TTFT (mean, median, p99) for each
mode, and the tokens kvstore served against two bounds: what a cache of prompts can
serve (the previous prompt's whole chunks) and what a cache of prompts and answers can
(the previous prompt and answer, less the answer's last token, in whole chunks). vLLM's
own prefix cache is off in both modes, so the comparison is recompute vs kvstore.
"""

from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.lab import Result
from bench.support.chat_model import build_chat_model, default_chat_model_dir
from bench.support.conversation import QUESTIONS, SYSTEM_PROMPT, Turn, converse
from bench.support.openai_server import OpenAIServer, chat
from bench.support.runs import CHUNK, SERVER_ARGS, default_config
from kvstore.config.store import load_config
from kvstore.service.client import stop_service


def _conversation(index: int) -> tuple[str, tuple[str, ...]]:
    """A distinct system prompt (its own prefix) and questions per conversation."""
    system = f"Conversation {index}. " + SYSTEM_PROMPT.replace("district", f"district-{index}")
    cities = ("Paris", "Berlin", "Rome", "Madrid", "Vienna", "Prague")
    a, b = cities[index % len(cities)], cities[(index + 1) % len(cities)]
    questions = tuple(q.replace("Paris", a).replace("Berlin", b) for q in QUESTIONS)
    return system, questions


def run_mode(url: str, conversations: int, think_s: float, max_tokens: int) -> list[list[Turn]]:
    with ThreadPoolExecutor(conversations) as pool:
        futures = [pool.submit(converse, url, "chat", questions, max_tokens=max_tokens, chunk_tokens=CHUNK,
                               system=system, gap_s=think_s)
                   for system, questions in map(_conversation, range(conversations))]
        return [f.result() for f in futures]


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def summarize(runs: dict[str, list[list[Turn]]]) -> list[dict[str, Any]]:
    """One row per (mode, turn index): TTFT statistics and cached tokens against the bounds."""
    rows = []
    for mode, conversations in runs.items():
        for t in range(len(conversations[0])):
            turns = [c[t] for c in conversations]
            previous = [c[t - 1] for c in conversations] if t else None
            ttft = [turn.ttft_s for turn in turns]
            prompt_bound = (sum(min(p.prompt_tokens, turn.common) // CHUNK * CHUNK
                                for p, turn in zip(previous, turns, strict=True)) if previous else 0)
            rows.append({"mode": mode, "turn": t + 1, "ttft_mean_s": statistics.mean(ttft),
                         "ttft_median_s": statistics.median(ttft), "ttft_p99_s": _p99(ttft),
                         "prompt_tokens": sum(turn.prompt_tokens for turn in turns),
                         "cached_tokens": sum(turn.cached_tokens for turn in turns),
                         "prompt_only_bound": prompt_bound,
                         "prompt_answer_bound": sum(turn.bound for turn in turns)})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'mode':<10} {'turn':>4} {'TTFT mean':>10} {'median':>8} {'p99':>8} {'prompt':>7} "
             f"{'cached':>7} {'prompt-only bound':>17} {'prompt+answer bound':>19}"]
    for row in rows:
        lines.append(f"{row['mode']:<10} {row['turn']:>4} {row['ttft_mean_s'] * 1000:>8.0f}ms "
              f"{row['ttft_median_s'] * 1000:>6.0f}ms {row['ttft_p99_s'] * 1000:>6.0f}ms "
              f"{row['prompt_tokens']:>7} {row['cached_tokens']:>7} {row['prompt_only_bound']:>17} "
              f"{row['prompt_answer_bound']:>19}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--think-s", type=float, default=0.0, help="pause between a reply and the next "
                        "question (0: agent style)")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--model", help="chat model directory (default: the built SmolLM2)")


def experiment(args: argparse.Namespace, workdir: Path) -> Result:
    model = Path(args.model) if args.model else build_chat_model(default_chat_model_dir())
    runs: dict[str, list[list[Turn]]] = {}
    config = default_config(workdir, "2GiB")
    for mode in ("recompute", "kvstore"):
        connector = {"config": config} if mode == "kvstore" else None
        with OpenAIServer(model, SERVER_ARGS, workdir / f"{mode}.log", connector=connector,
                          kv_cache_gib=2) as server:
            chat(server.url, "chat", [{"role": "user", "content": "Say hello."}], 8)  # warm-up
            runs[mode] = run_mode(server.url, args.conversations, args.think_s, args.max_tokens)
    stop_service(load_config(config))
    rows = summarize(runs)
    return Result(table(rows), {"rows": rows,
                                "turns": {m: [[vars(t) for t in c] for c in cs] for m, cs in runs.items()}})
