"""The TTFT of a prompt whose prefix kvstore's DRAM tier holds, against what bounds it:
the same server's own prefix-cache hit (the floor: nothing to load), recomputing the
prefix, and a plain copy of the prefix's KV bytes in one process (the least a load
moves). The goal it checks: a DRAM hit costs at most the floor plus one plain copy.

vLLM's OpenAI server with the Llama-3-8B-geometry model (32 MiB of KV per 256-token
chunk, bench/support/tiny_model.py), as a user starts it. For each of --prompts prompts
(a --prefix-tokens prefix of its own, then --suffix-tokens more):
  recompute  the prompt's first request on the server with kvstore (vLLM's prefix cache
             off): computed whole, its prefix chunks saved to the DRAM tier
  kvstore    the same prompt again on that server, once its saves are done: loaded
             (vLLM's prefix cache is off there: every request of it again is a load)
  floor      on a server without kvstore and with vLLM's prefix cache, the prompt sent
             once, then again: a prefix-cache hit
Both servers run at once and take turns, --repeats timed requests of each prompt each, so
drift on a shared machine touches both alike; the one whose turn it is not is stopped
(SIGSTOP: an idle vLLM server's workers spin on their queues, a core taken from the one
timed). Each is the time to the first streamed token; the table shows the medians, and
the median of (kvstore - the floor timed just before it) / plain copy: one request's TTFT
here varies by more than the copy takes. Beside it, the mean time the engine's worker spent
copying a load into its KV blocks, by its own timer (counters it reports to the service):
the part of the extra that is the copy, against the plain copy. With --streaming-stores both
servers start with the GLIBC_TUNABLES the connector's worker logs it would want
(engine_plugin/vllm/worker_role.py): its loads' copies then stream past the cache, as the
plain copy of the whole prefix does.
With --huge-pages the service's DRAM tier is in reserved huge pages (its start-up warning
asks for them where there are none). With --copy-cpus the worker may also copy a load on
those CPUs (the connector's `load_copy_cpus`), beside the one vLLM binds it to.

  python -m bench.lab dram_hit [--prefix-tokens 4096] [--suffix-tokens 16] [--prompts 3] [--repeats 5]
                               [--streaming-stores] [--huge-pages] [--copy-cpus LIST]
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np

from bench.lab import Result
from bench.support.openai_server import OpenAIServer, completion_body, stream_complete
from bench.support.tiny_model import build_llama3_8b_geometry, prompt_token_ids
from bench.support.vm import huge_pages
from kvstore.config.store import load_config
from kvstore.format.units import parse_size
from kvstore.io.streaming import REP_MOVSB, REP_MOVSB_ABOVE, TUNABLE
from kvstore.service.client import service_info, stop_service

CHUNK = 256
KV_BYTES_PER_TOKEN = 128 << 10  # the model's float16 KV: 32 layers x 8 heads x 128 x 2 (K, V) x 2 bytes
STREAMING = f"{TUNABLE}=0x20000:{REP_MOVSB}={REP_MOVSB_ABOVE:#x}"  # what the worker logs for this model


def plain_copy_s(nbytes: int, rounds: int = 5) -> float:
    """The fastest of `rounds` copies of `nbytes` between two buffers of this process."""
    source, target = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - started)
    return best


def _ttft(server: OpenAIServer, prompt: list[int]) -> tuple[float, int]:
    """(time to the first token, cached tokens) of one greedy one-token completion."""
    done, first = stream_complete(server.url, completion_body(server.model, prompt, 1))
    return first, done.cached_tokens


def _saves_done(store: dict[str, Any], chunks: int, timeout_s: float = 60) -> None:
    """Wait until the service holds at least `chunks` chunks in DRAM."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = service_info(load_config(store)) or {}
        if sum(t["chunks"] for t in info.get("tiers", []) if t.get("name") == "dram") >= chunks:
            return
        time.sleep(0.2)


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    model = args.model or str(build_llama3_8b_geometry(workdir / "model-8b"))
    length = args.prefix_tokens + args.suffix_tokens
    prompts = [prompt_token_ids(length, seed=100 + i) for i in range(args.prompts)]
    base = ["--dtype", "float16", "--enforce-eager", "--enable-prompt-tokens-details",
            "--max-model-len", str(args.prefix_tokens + args.suffix_tokens + 64),
            "--max-num-batched-tokens", str(args.prefix_tokens + args.suffix_tokens)]
    store = {"chunk_tokens": CHUNK, "tiers": {"dram": {"capacity": args.dram_capacity}},
             "service": {"socket": str(workdir / "kvstore.sock")}}
    env = {"GLIBC_TUNABLES": STREAMING} if args.streaming_stores else {}
    found: dict[str, list[float]] = {"recompute": [], "kvstore": [], "floor": []}
    cached: list[int] = []
    pages = huge_pages(parse_size(args.dram_capacity)) if args.huge_pages else nullcontext("not asked")
    with pages as why_not:  # held until the service (which holds the pages) has stopped
        try:
            with OpenAIServer(model, [*base, "--no-enable-prefix-caching"], workdir / "server-kvstore.log",
                              connector={"config": store, "load_async": not args.sync_load,
                                         **({"load_copy_cpus": args.copy_cpus} if args.copy_cpus else {})},
                              kv_cache_gib=args.kv_cache_gib, env=env) as server, \
                 OpenAIServer(model, base, workdir / "server-floor.log", kv_cache_gib=args.kv_cache_gib,
                              env=env) as floor:
                for i, prompt in enumerate(prompts):  # the two take turns, the other one stopped
                    with floor.paused():
                        found["recompute"].append(_ttft(server, prompt)[0])
                        _saves_done(store, (i + 1) * (args.prefix_tokens // CHUNK))
                    with server.paused():
                        _ttft(floor, prompt)  # into its prefix cache
                    for _ in range(args.repeats):  # each request again a hit of each kind
                        with server.paused():
                            found["floor"].append(_ttft(floor, prompt)[0])
                        with floor.paused():
                            seconds, hit = _ttft(server, prompt)
                        found["kvstore"].append(seconds)
                        cached.append(hit)
            counters = (service_info(load_config(store)) or {}).get("counters", {})
        finally:
            stop_service(load_config(store))
    loads = counters.get("load.leased_chunks", 0) / (args.prefix_tokens // CHUNK)
    copy = plain_copy_s(args.prefix_tokens * KV_BYTES_PER_TOKEN)
    medians = {name: statistics.median(values) for name, values in found.items()}
    pairs = [hit - floor for hit, floor in zip(found["kvstore"], found["floor"], strict=True)]
    extra = statistics.median(pairs) / copy
    service = {k: v for k, v in counters.items() if k.startswith(("load.", "dram.", "get.", "requests."))}
    return {"prefix_tokens": args.prefix_tokens, "glibc_tunables": env.get("GLIBC_TUNABLES"),
            "load_copy_cpus": args.copy_cpus,
            "tier_huge_pages": why_not or "reserved",
            "runs": found, "median_s": medians, "plain_copy_s": copy,
            "kvstore_cached_tokens": cached, "extra_over_floor_in_copies": extra, "service_counters": service,
            "copy_in_engine_s": counters.get("load.leased_copy_us", 0) / 1e6 / loads if loads else None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: build the 8B-geometry one)")
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--suffix-tokens", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed requests of each prompt on each server, the two alternated")
    parser.add_argument("--kv-cache-gib", type=int, default=3, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--dram-capacity", default="4GiB", help="kvstore's DRAM tier")
    parser.add_argument("--huge-pages", action="store_true",
                        help="reserve huge pages for the DRAM tier while the kvstore service runs (root; "
                             "vm.nr_hugepages is put back after), as the service's warning asks")
    parser.add_argument("--streaming-stores", action="store_true",
                        help=f"start both servers with GLIBC_TUNABLES={STREAMING}: copies of a layer's "
                             "block and more stream past the cache")
    parser.add_argument("--copy-cpus", default="",
                        help="the connector's load_copy_cpus: CPUs the worker may also copy a load on "
                             "(e.g. 1: the one vLLM keeps for its front end on a 2-core machine)")
    parser.add_argument("--sync-load", action="store_true",
                        help="the connector's load_async false: the load runs before the forward pass "
                             "of the step that computes the rest, not while the request waits")


def experiment(args: argparse.Namespace, workdir: Path) -> Result:
    found = measure(args, workdir)
    m, copy = found["median_s"], found["plain_copy_s"]
    inside = found["copy_in_engine_s"]
    engine_copy = "not reported" if inside is None else f"{inside:.3f} ({inside / copy:.2f} plain copies)"
    table = "\n".join([
        f"prefix {found['prefix_tokens']} tokens ({found['prefix_tokens'] * KV_BYTES_PER_TOKEN >> 20} MiB "
        f"of KV), medians of {len(found['runs']['recompute'])} prompts' {len(found['runs']['floor'])} "
        "timed requests of each kind:",
        "| TTFT | s |", "| --- | ---: |",
        f"| floor (vLLM's own prefix-cache hit) | {m['floor']:.3f} |",
        f"| kvstore DRAM hit | {m['kvstore']:.3f} |",
        f"| recompute | {m['recompute']:.3f} |",
        f"| plain copy of the prefix's KV | {copy:.3f} |",
        f"| kvstore's copy of the prefix into the KV blocks (its worker's timer, mean) | {engine_copy} |",
        f"kvstore's extra over the floor (the median of each hit less the floor timed just before it): "
        f"{found['extra_over_floor_in_copies']:.2f} plain copies (goal: at most 1); "
        f"cached tokens {sorted(set(found['kvstore_cached_tokens']))}"])
    ok = all(c >= found["prefix_tokens"] for c in found["kvstore_cached_tokens"])
    return Result(table, found, ok=ok)
