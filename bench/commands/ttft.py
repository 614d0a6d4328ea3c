"""`kvstore ttft`: recompute vs offload, measured on a real engine or estimated.

Measure mode, for each context length, each run a fresh vLLM engine process (vLLM's
own prefix cache dies with it, so only kvstore can supply the KV):
  recompute   no connector: the reference TTFT and greedy tokens
  save        connector on, nothing stored yet: prefill, then the chunks are saved
  dram        a fresh engine; chunks come from the service's DRAM tier
  disk        the service restarted (DRAM gone); chunks come from disk with O_DIRECT
              reads, so the page cache is out of the way
`save` runs whenever dram or disk is asked for (it fills the store). Each mode's greedy
tokens are judged against recompute's as vLLM's tests judge them (bench/support/answers.py: equal,
or a near-tie at the first difference), and the disk run, which loads the chunks the dram
run loaded, must give the dram run's tokens and logprobs to the bit. Every context runs in
float16, and in bfloat16 too on a CPU with AMX (bench/support/cpu_dtypes.py; `--dtypes`). The
estimate mode (--estimate) applies bench/sim/ttft_model.py to a model and a hardware profile.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.commands.queued import measure_queued
from bench.support.answers import Tokens, identical, judge_results
from bench.support.cpu_dtypes import checked_dtypes
from bench.support.engine_run import run_fresh
from bench.support.runs import default_config, run_workdir
from bench.support.summary import p50_p90
from bench.support.tiny_model import build_tiny_llama, prompt_token_ids
from kvstore.config.store import dump_config, load_config
from kvstore.format.errors import ConfigError
from kvstore.format.units import parse_size
from kvstore.service.client import stop_service

MEASURED_MODES = ("recompute", "dram", "disk", "disk+prefetch")
DEFAULT_CONTEXTS = "1024,2048,4096,8192,16384"


def demo_model(workdir: Path) -> Path:
    """The default model: a 4-layer random-weight Llama, built locally."""
    return build_tiny_llama(workdir / "model", layers=4, hidden=512, heads=8, kv_heads=4)


def measure(model: Path, workdir: Path, contexts: list[int], modes: list[str], prompts: int,
            config: dict[str, Any], single_process: bool = False,
            progress: Callable[[str], None] = print, device_staging: int = 0,
            dtype: str = "float16") -> list[dict[str, Any]]:
    """Rows {mode, dtype, context_tokens, ttft_p50_s, ttft_p90_s, speedup, loaded_tokens,
    answers, answers_close}."""
    unknown = set(modes) - set(MEASURED_MODES)
    if unknown:
        raise ConfigError("--modes", ",".join(sorted(unknown)),
                          f"measurable modes are {', '.join(MEASURED_MODES)}")
    store = load_config(config)
    rows = []
    for context in contexts:
        prompts_file = workdir / f"prompts-{context}.json"
        prompts_file.write_text(json.dumps([prompt_token_ids(context, seed=1000 * context + i)
                                            for i in range(prompts)]))

        def engine(mode: str, connector: bool, context: int = context,
                   prompts_file: Path = prompts_file) -> tuple[str, list[dict[str, Any]]]:
            progress(f"  {context} tokens, {dtype}, {mode}: a fresh vLLM engine ...")
            run = run_fresh(model, prompts_file, {"config": dump_config(store)} if connector else None,
                            single_process=single_process, max_model_len=context + 64, dtype=dtype)
            return mode, run.results

        stop_service(store)  # start from an empty DRAM tier and a known disk state
        runs = [engine("recompute", False)]
        if {"dram", "disk", "disk+prefetch"} & set(modes):
            runs.append(engine("save", True))
        if "dram" in modes:
            runs.append(engine("dram", True))
        if "disk" in modes:
            stop_service(store)  # writes DRAM down, checkpoints; the next run starts a new one
            runs.append(engine("disk", True))
        rows.extend(_rows(context, runs, dtype))
        if "disk+prefetch" in modes:
            rows.extend(measure_queued(model, workdir, context, prompts_file, store, single_process,
                                       progress, device_staging, dtype))
        stop_service(store)
    return rows


def _rows(context: int, runs: list[tuple[str, list[dict[str, Any]]]], dtype: str) -> list[dict[str, Any]]:
    base, _ = p50_p90(r["ttft_s"] for r in runs[0][1])
    loaded = dict(runs)
    rows = []
    for mode, results in runs:
        p50, p90 = p50_p90(r["ttft_s"] for r in results)
        row = {"mode": mode, "dtype": dtype, "context_tokens": context, "ttft_p50_s": p50, "ttft_p90_s": p90,
               "speedup": base / p50, "loaded_tokens": min(r["num_cached_tokens"] for r in results),
               **judge_results(runs[0][1], results, mode)}
        if mode == "disk" and "dram" in loaded:  # the same chunks as the dram run: the same bits
            same = [identical(Tokens.of(a), Tokens.of(b))
                    for a, b in zip(loaded["dram"], results, strict=True)
                    if a["num_cached_tokens"] == b["num_cached_tokens"]]
            row["identical_to_dram"] = all(same)
            row["answers_close"] = row["answers_close"] and all(same)
        rows.append(row)
    return rows



def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'context':>8} {'dtype':>8} {'mode':<22} {'TTFT p50':>10} {'TTFT p90':>10} {'ratio':>15} "
          f"{'from kvstore':>12} {'from DRAM':>9} {'on device':>9}  answers")

    def percent(value: float | None) -> str:
        return "" if value is None else f"{value:.0%}"

    for row in rows:
        ratio = (f"{row['speedup']:.2f}x faster" if "speedup" in row
                 else f"{row['vs_dram']:.2f}x of dram")
        same = {True: ", bit-identical to dram", False: ", NOT identical to dram", None: ""}[
            row.get("identical_to_dram")]
        print(f"{row['context_tokens']:>8} {row['dtype']:>8} {row['mode']:<22} "
              f"{row['ttft_p50_s'] * 1000:>8.1f}ms {row['ttft_p90_s'] * 1000:>8.1f}ms {ratio:>15} "
              f"{row['loaded_tokens']:>12} "
              f"{percent(row.get('resident_fraction')):>9} {percent(row.get('device_resident_fraction')):>9}"
              f"  {row['answers']}{same}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--modes", default="recompute,dram,disk",
                        help="measure: recompute,dram,disk; --estimate: recompute,dram,disk,nvmeof")
    parser.add_argument("--contexts", default=DEFAULT_CONTEXTS, help="context lengths in tokens")
    parser.add_argument("--model", help="measure: a local model directory (default: the tiny "
                        "model); --estimate: a config.json/directory or a preset name")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per context (measure)")
    parser.add_argument("--config", help="kvstore config for the tiers (default: a temp directory)")
    parser.add_argument("--workdir", help="where the model, prompts and tiers go, kept "
                        "(default: a temporary directory, removed at the end)")
    parser.add_argument("--disk-capacity", default="4GiB",
                        help="disk tier size without --config (reserved on disk for the run)")
    parser.add_argument("--single-process", action="store_true")
    parser.add_argument("--dtypes", help="measure in these dtypes, e.g. float16,bfloat16 (default: "
                        "float16, and bfloat16 too on a CPU with AMX)")
    parser.add_argument("--device-staging", default="0",
                        help="disk+prefetch: also stage chunks into a device pool of this size")
    parser.add_argument("--estimate", action="store_true",
                        help="estimate from a model config and a hardware profile instead")
    parser.add_argument("--hardware", default="h100", help="h100, h200, mi300x, rtx4090 (--estimate)")
    parser.add_argument("--json", help="write results here; a PNG plot goes next to it")


def run(args: argparse.Namespace) -> int:
    contexts = [int(c) for c in args.contexts.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    if args.estimate:
        return _run_estimate(args, contexts, modes)
    with run_workdir(args.workdir, "kvstore-ttft-") as workdir:
        model = Path(args.model) if args.model else demo_model(workdir)
        config = load_config(args.config or default_config(workdir, args.disk_capacity))
        dtypes = args.dtypes.split(",") if args.dtypes else checked_dtypes()
        rows = [row for dtype in dtypes
                for row in measure(model, workdir, contexts, modes, args.prompts, dump_config(config),
                                   args.single_process, device_staging=parse_size(args.device_staging),
                                   dtype=dtype)]
    print_rows(rows)
    _write(args.json, {"model": str(model), "results": rows}, rows, "ttft_p50_s")
    return 0 if all(row["answers_close"] for row in rows) else 1


def _run_estimate(args: argparse.Namespace, contexts: list[int], modes: list[str]) -> int:
    from bench.sim.ttft_model import PROFILES, estimate, model_spec

    if args.hardware not in PROFILES:
        raise ConfigError("--hardware", args.hardware, f"known: {', '.join(PROFILES)}")
    model = model_spec(args.model or "llama-3.1-8b")
    result = estimate(model, PROFILES[args.hardware], contexts, [m for m in modes if m != "recompute"])
    print(f"{model.name} on {PROFILES[args.hardware].name}: {model.kv_bytes_per_token} KV bytes/token")
    print(f"{'context':>8} " + " ".join(f"{m:>10}" for m in ["recompute", *result['crossover_context']]))
    for context in contexts:
        cells = [r["ttft_s"] for r in result["results"] if r["context_tokens"] == context]
        print(f"{context:>8} " + " ".join(f"{c * 1000:>8.1f}ms" for c in cells))
    print("loading beats recomputing from: " + ", ".join(
        f"{tier} {n if n else 'never (in this range)'}" for tier, n in result["crossover_context"].items()))
    _write(args.json, result, result["results"], "ttft_s")
    return 0


def _write(json_path: str | None, document: dict[str, Any], rows: list[dict[str, Any]],
           value: str) -> None:
    if not json_path:
        return
    Path(json_path).write_text(json.dumps(document, indent=2))
    from bench.commands.plots import PlotUnavailable, plot_ttft

    try:
        plot = str(plot_ttft(rows, value, Path(json_path).with_suffix(".png")))
    except PlotUnavailable as exc:
        plot = str(exc)
    print(f"results: {json_path}, plot: {plot}")
