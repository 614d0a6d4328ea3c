"""The prefetch experiment of `kvstore ttft --modes ...,disk+prefetch`: requests whose
long prefixes sit in kvstore queue behind a busy engine.

Every run is a fresh engine given the same batch at once: `busy` prompts (new tokens,
nothing stored) first, then the measured prompts. While the engine prefills the busy
ones, the measured ones wait; with prefetch on, their arrival has already started
promoting their chunks from disk to DRAM. Three runs, one row each:
  dram (queued)           chunks in DRAM: the target
  disk (queued)           DRAM emptied (service restarted), prefetch off: disk reads at load
  disk+prefetch (queued)  DRAM emptied, prefetch on (the connector's policy)
`resident_fraction` is the share of the measured requests' loaded chunks that came from
DRAM rather than disk (the service's dram.hits / (dram.hits + disk.hits) in that run).
With `device_staging` (bytes), the runs also stage chunks into the workers' device pools
on arrival, and `device_resident_fraction` is the share of loaded chunks taken from there
(staging.hits / staging.loaded_chunks).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.support.answers import judge_results
from bench.support.engine_run import run_fresh
from bench.support.summary import p50_p90
from bench.support.tiny_model import prompt_token_ids
from kvstore.config.store import StoreConfig, dump_config
from kvstore.service.client import service_info, stop_service

BUSY_PROMPTS = 2


def _service_counters(store: StoreConfig) -> dict[str, int]:
    info = service_info(store)
    return dict(info["counters"]) if info is not None else {}


def measure_queued(model: Path, workdir: Path, context: int, prompts_file: Path, store: StoreConfig,
                   single_process: bool, progress: Callable[[str], None],
                   device_staging: int = 0, dtype: str = "float16") -> list[dict[str, Any]]:
    """Rows for the three runs; the measured prompts must already be stored (a save run)."""
    runs = []
    for n, (mode, prefetch, restart) in enumerate((("dram (queued)", True, False),
                                                   ("disk (queued)", False, True),
                                                   ("disk+prefetch (queued)", True, True))):
        # New busy prompts per run: the connector stores each run's, and a stored busy
        # prompt would load instead of keeping the engine busy.
        busy_file = workdir / f"busy-{context}-{n}.json"
        seed = 7_000_000 + 1000 * context + 10 * n
        busy = [prompt_token_ids(context, seed=seed + i) for i in range(BUSY_PROMPTS)]
        busy_file.write_text(json.dumps(busy))
        if restart:
            stop_service(store)  # DRAM written down and emptied: the chunks are on disk only
        before = _service_counters(store)
        progress(f"  {context} tokens, {mode}: {BUSY_PROMPTS} busy prompts ahead, a fresh vLLM engine ...")
        options = {"config": dump_config(store), "prefetch": prefetch,
                   "device_staging": device_staging if prefetch else 0}
        run = run_fresh(model, prompts_file, options, single_process=single_process,
                        max_model_len=context + 64, busy_file=busy_file, dtype=dtype)
        after = _service_counters(store)
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        runs.append((mode, run.results, delta))
    return _rows(context, runs, dtype)


def _rows(context: int, runs: list[tuple[str, list[dict[str, Any]], dict[str, int]]],
          dtype: str) -> list[dict[str, Any]]:
    """Answers are judged against the dram (queued) run's (bench/support/answers.py): each run
    batches other busy prompts, so only vLLM's bar applies, not bit equality."""
    dram_p50, _ = p50_p90(r["ttft_s"] for r in runs[0][1])
    rows = []
    for mode, results, counters in runs:
        dram, disk = counters.get("dram.hits", 0), counters.get("disk.hits", 0)
        p50, p90 = p50_p90(r["ttft_s"] for r in results)
        rows.append({"mode": mode, "dtype": dtype, "context_tokens": context, "busy_prompts": BUSY_PROMPTS,
                     "ttft_p50_s": p50, "ttft_p90_s": p90, "vs_dram": p50 / dram_p50,
                     "resident_fraction": dram / (dram + disk) if dram + disk else None,
                     "device_resident_fraction": (counters["staging.hits"] / counters["staging.loaded_chunks"]
                                                  if counters.get("staging.loaded_chunks") else None),
                     "prefetch_counters": {k: v for k, v in counters.items()
                                           if k.startswith(("prefetch.", "staging."))},
                     "loaded_tokens": min(r["num_cached_tokens"] for r in results),
                     **judge_results(runs[0][1], results, mode)})
    return rows
