"""Time to first token on SGLang's own server: a prompt loaded by kvstore against SGLang's `file` backend.

    python -m bench.lab sglang_ttft [--prompt-tokens 2048] [--rounds 3] [--layout layer_first]
        [--json out.json]

Run from .venv; the servers run in .venv-sglang (scripts/setup_sglang.sh) on the CPU,
through bench/support/sglang_cpu.py (bench/support/sglang_server.py starts them). Each round, for each
storage backend, a fresh store and two servers in turn:

- server A answers two prompts of the same length (P1, P2) from scratch (nothing stored
  yet: its TTFT is the recompute time) and stores them; it is stopped once they are;
- server B, a new process, answers P1 (kvstore: from its DRAM tier; HiCacheFile: from its
  files, still in the OS page cache), then, for kvstore, after `kvstore stop` (its DRAM
  tier gone; B reconnects first, as bench/support/sglang_server.py's tests do) P2 from its disk
  tier, and for HiCacheFile P2 after its files were dropped from the page cache
  (posix_fadvise DONTNEED).

Every server first answers a prompt shorter than a page (nothing of it is stored), so no
measured request pays a warm-up. TTFT is measured on /generate, streamed, from sending
the request to the first token. Every B answer must report its full pages loaded from
storage and agree with A's (bench/support/answers.py); the run fails otherwise. Printed: each
request's TTFT, and per round each load's TTFT over the recompute TTFT of the same
backend's A (ratios, not times: the machine is shared); the medians over the rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.lab import Result, Unavailable
from bench.support.answers import compare
from bench.support.chat_model import build_chat_model, default_chat_model_dir
from bench.support.runs import wait_held
from bench.support.sglang_server import (
    PAGE_TOKENS,
    VOCAB,
    Generation,
    SGLangServer,
    file_backend,
    kvstore_backend,
    kvstore_store,
    reconnect,
    sglang_python,
)
from bench.support.tiny_model import prompt_token_ids
from kvstore.config.store import load_config
from kvstore.service.client import stop_service

NEW_TOKENS = 4
LOADS = ("kvstore DRAM", "kvstore disk", "HiCacheFile page cache", "HiCacheFile disk")


@dataclass
class Request:
    round: int
    what: str  # "recompute (kvstore's A)", "kvstore DRAM", ...
    ttft_s: float
    storage_tokens: int
    agrees: bool  # B's answer agrees with A's (for A's own: True)
    recompute_s: float  # A's TTFT for the same prompt


def warm_up(server: SGLangServer) -> None:
    server.generate(prompt_token_ids(PAGE_TOKENS // 2, seed=7, vocab=VOCAB), 1)


def kvstore_round(python: Path, model: Path, work: Path, prompts: list[list[int]], layout: str,
                  number: int) -> list[Request]:
    store, config = kvstore_store(work, dram="1GiB", disk="2GiB")
    backend = kvstore_backend(config, prefetch_threshold=PAGE_TOKENS)
    try:
        with SGLangServer(python, model, backend, work / "a.log", layout=layout) as a:
            warm_up(a)
            computed = [a.generate(prompt, NEW_TOKENS) for prompt in prompts]
            pages = sum(len(p) // PAGE_TOKENS for p in prompts)
            if wait_held(store, pages) < pages:
                raise RuntimeError(f"kvstore's DRAM tier did not reach {pages} pages")
        with SGLangServer(python, model, backend, work / "b.log", layout=layout) as b:
            warm_up(b)
            dram = b.generate(prompts[0], NEW_TOKENS)
            stop_service(load_config(store))
            reconnect(b)
            disk = b.generate(prompts[1], NEW_TOKENS)
    finally:
        stop_service(load_config(store))
    return [*recomputed(number, "kvstore's A", computed), loaded(number, "kvstore DRAM", computed[0], dram),
            loaded(number, "kvstore disk", computed[1], disk)]


def file_round(python: Path, model: Path, work: Path, prompts: list[list[int]], layout: str,
               number: int) -> list[Request]:
    files = work / "hicache"
    backend = file_backend(files, prefetch_threshold=PAGE_TOKENS)
    with SGLangServer(python, model, backend, work / "a.log", layout=layout) as a:
        warm_up(a)
        computed = [a.generate(prompt, NEW_TOKENS) for prompt in prompts]
        pages = sum(len(p) // PAGE_TOKENS for p in prompts)
        wait_files(files, pages)
    with SGLangServer(python, model, backend, work / "b.log", layout=layout) as b:
        warm_up(b)
        cached = b.generate(prompts[0], NEW_TOKENS)
        drop_page_cache(files)
        cold = b.generate(prompts[1], NEW_TOKENS)
    return [*recomputed(number, "HiCacheFile's A", computed),
            loaded(number, "HiCacheFile page cache", computed[0], cached),
            loaded(number, "HiCacheFile disk", computed[1], cold)]


def wait_files(directory: Path, pages: int, timeout_s: float = 120) -> None:
    """HiCacheFile writes a file per page behind the request: wait until there are as
    many, or their count has not grown for 5 s (B's answers then show what was stored)."""
    deadline = time.monotonic() + timeout_s
    seen, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        count = len(stored_files(directory))
        if count >= pages or (count == seen and count and time.monotonic() - since > 5):
            return
        if count != seen:
            seen, since = count, time.monotonic()
        time.sleep(0.5)


def stored_files(directory: Path) -> list[Path]:
    return [path for path in directory.rglob("*") if path.is_file()] if directory.exists() else []


def drop_page_cache(directory: Path) -> None:
    os.sync()  # dirty pages are not dropped: written back first
    for path in stored_files(directory):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def recomputed(number: int, server: str, answers: list[Generation]) -> list[Request]:
    return [Request(number, f"recompute ({server}, P{i})", a.ttft_s, a.storage, True, a.ttft_s)
            for i, a in enumerate(answers, start=1)]


def loaded(number: int, what: str, reference: Generation, answer: Generation) -> Request:
    agrees = compare(reference, answer).close
    return Request(number, what, answer.ttft_s, answer.storage, agrees, reference.ttft_s)


def report(requests: list[Request], prompt_tokens: int, header: str) -> tuple[str, bool]:
    """Every request and the ratios, under `header`; and True where every load was whole
    and agreed."""
    full = (prompt_tokens - 1) // PAGE_TOKENS * PAGE_TOKENS  # whole pages, one token at least computed
    lines = [header, "| round | request | TTFT s | storage tokens | answer agrees with A |",
             "| --- | --- | --- | --- | --- |"]
    for r in requests:
        agrees = "yes" if r.agrees else "NO"
        lines.append(f"| {r.round} | {r.what} | {r.ttft_s:.3f} | {r.storage_tokens} | {agrees} |")
    ratios: dict[str, list[float]] = {what: [] for what in LOADS}
    for r in requests:
        if r.what in ratios:
            ratios[r.what].append(r.ttft_s / r.recompute_s)
    rounds = " | ".join(f"round {n}" for n in sorted({r.round for r in requests}))
    lines += ["\nTTFT over A's recompute TTFT for the same prompt (same backend, same round), and the "
              "median:",
              f"| load | {rounds} | median |", "| --- |" + " --- |" * (len(ratios[LOADS[0]]) + 1)]
    for what, values in ratios.items():
        cells = " | ".join(f"{v:.2f}" for v in values)
        lines.append(f"| {what} | {cells} | {statistics.median(values):.2f} |")
    kv, files = (statistics.median(ratios[w]) for w in ("kvstore disk", "HiCacheFile disk"))
    lines.append(f"\nkvstore disk hit TTFT / HiCacheFile disk hit TTFT (medians of the ratios): "
                 f"{kv / files:.2f}")
    good = all(r.agrees and r.storage_tokens == (0 if r.what.startswith("recompute") else full)
               for r in requests)
    return "\n".join(lines), good


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layout", choices=("layer_first", "page_first"), default="layer_first",
                        help="SGLang's host-pool layout (--hicache-mem-layout)")


def experiment(args: argparse.Namespace, workdir: Path) -> Result:
    python = sglang_python()
    if python is None:
        raise Unavailable("needs .venv-sglang: bash scripts/setup_sglang.sh")
    model = build_chat_model(default_chat_model_dir())
    requests: list[Request] = []
    for number in range(1, args.rounds + 1):
        prompts = [prompt_token_ids(args.prompt_tokens, seed=100 * number + i, vocab=VOCAB)
                   for i in (1, 2)]
        for name, run in (("kvstore", kvstore_round), ("file", file_round)):
            work = workdir / f"round{number}" / name
            (work / "run").mkdir(mode=0o700, parents=True, exist_ok=True)
            done = run(python, model, work, prompts, args.layout, number)
            requests += done
            for r in done:
                print(f"round {number}: {r.what}: TTFT {r.ttft_s:.3f} s, {r.storage_tokens} tokens from "
                      f"storage, agrees {r.agrees}", flush=True)
    table, good = report(requests, args.prompt_tokens,
                         f"SmolLM2-135M-Instruct, {args.prompt_tokens}-token prompts, {args.layout} host "
                         f"pool, pages of {PAGE_TOKENS} tokens")
    arguments = {k: v for k, v in vars(args).items() if k not in ("json", "workdir")}
    return Result(table, {"args": arguments, "requests": [asdict(r) for r in requests]}, ok=good)
