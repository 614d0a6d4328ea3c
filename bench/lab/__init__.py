"""The experiments: each `bench/lab/NAME.py` measures one thing and is run as

    python -m bench.lab NAME [its flags] [--workdir DIR] [--json PATH]

by one runner (bench/lab/runner.py), which owns what every experiment did alike: the
command line's common flags, the work directory (the user's `--workdir`, kept, or a
temporary one, removed with everything in it), printing the table and writing `--json`.

An experiment module gives
    add_arguments(parser)   its own flags
    experiment(args, workdir)  the measurement -> Result; raises Unavailable when this
                               machine lacks what it needs (the runner says why, exits 2)
and may set WORKDIR_PARENT (where its temporary work directory goes, e.g. /var/tmp for
O_DIRECT) and JSON_DEFAULT (a --json written even when not asked for).

EXPERIMENTS lists them with one line each, without importing any: torch, vLLM, LMCache or
SGLang load only for the experiment being run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EXPERIMENTS: tuple[tuple[str, str], ...] = (
    ("chat_bench", "multi-turn chat serving, several conversations at once, without and with kvstore"),
    ("cluster_bench", "what the cluster path costs: index lookups, publishing, peer reads"),
    ("dram_hit", "TTFT of a DRAM hit through vLLM's server, against its own prefix-cache hit, recompute "
                 "and a plain copy"),
    ("gpu_check", "everything that needs a GPU in one run of at most 8 minutes (scripts/gpu_check.sh)"),
    ("hybrid_groups", "bytes per token and TTFT of a load for the Gemma-3-style hybrid model"),
    ("index_load", "the cluster index under load: one Redis against a Redis Cluster of 3 shards"),
    ("key_cost", "what naming KV with SHA-256 costs: chunk keys and an image's content name, against "
                 "xxh3 and a plain copy"),
    ("lmcache_bench", "loading LMCache chunks: kvstore's plugin against LMCache's LocalDiskBackend "
                      "(.venv-lmcache)"),
    ("load_path", "load-path throughput: the DRAM tier into an engine's paged KV, through the service"),
    ("piece_hash", "the checked copy's piecewise hash: the C library's plain update against its "
                   "SIMD-dispatching one, and a copy"),
    ("pd", "prefill/decode disaggregation through kvstore behind vLLM's router, against one server"),
    ("save_path", "what a save costs its caller once DRAM is full: with the DRAM cleaner, without, and "
                  "into free slots"),
    ("serving", "vLLM's own serving benchmark without and with kvstore, or one long prompt"),
    ("sglang_bench", "loading SGLang HiCache pages: kvstore's backend against SGLang's `file` backend"),
    ("sglang_ttft", "TTFT on SGLang's own server: kvstore against SGLang's `file` backend (.venv-sglang)"),
    ("vllm_tier", "vLLM's own tiered offloading: kvstore as its secondary tier against vLLM's `fs` tier"),
    ("weights_cost", "what the weights fingerprint costs: cold, again, and through its digest cache"),
)


@dataclass
class Result:
    """What one run of an experiment found."""

    table: str  # printed
    document: Any  # written as JSON by --json
    ok: bool = True  # the runner exits 0, else 1 (a goal the experiment checks was missed)
    value: Any = None  # what a caller in Python gets besides (e.g. the rounds' own objects)


class Unavailable(Exception):
    """This machine cannot run the experiment (a program or a virtualenv is missing, or the
    flags contradict each other): the message says why."""
