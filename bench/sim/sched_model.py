"""A chunked-prefill scheduler model: TTFT of a trace when cache hits are loaded.

Per step, as vLLM's scheduler does: every running request decodes one token first;
prefill chunks of waiting requests (first come, first served) fill the rest of the
token budget. A request's prefill starts once its cache hits are loaded: each tier
is one channel at that tier's bandwidth, serving loads in arrival order. Its first
token comes at the end of the step that computes its last prompt token.

Step time: max(weight read, compute) with
  weight read = 2 * P bytes / HBM bandwidth           (every step reads the weights)
  compute     = (2 * P * tokens + 2 * L * A * sum(context of each prefill token))
                / (FLOP/s * mfu)
so a step of decodes is memory-bound and a step of long prefills compute-bound.
"""

from __future__ import annotations

import heapq
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.sim.ttft_model import HardwareProfile, ModelSpec


@dataclass
class SimRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    hits: dict[str, int] = field(default_factory=dict)  # tier -> tokens loaded from it
    ready_s: float = 0.0  # loads done
    computed: int = 0  # prompt tokens with KV (loaded or computed)
    first_token_s: float | None = None
    decoded: int = 0


def step_seconds(model: ModelSpec, hw: HardwareProfile, prefill: Sequence[tuple[int, int]],
                 decodes: int) -> float:
    """`prefill`: (start position, tokens) of each chunk computed this step."""
    tokens = decodes + sum(n for _, n in prefill)
    attention = sum(n * start + n * (n + 1) / 2 for start, n in prefill)  # context summed over tokens
    compute = (2 * model.params * tokens + 2 * model.layers * model.heads * model.head_dim * attention)
    weights = 2 * model.params / (hw.hbm_gbps * 1e9)
    return max(weights, compute / (hw.bf16_tflops * 1e12 * hw.mfu))


def simulate(requests: list[SimRequest], model: ModelSpec, hw: HardwareProfile,
             tier_paths: dict[str, str], budget: int = 8192) -> dict[str, float]:
    """Run the trace; returns TTFT p50/p90 (s) and output-token throughput (tokens/s).

    `tier_paths` maps each tier name to its path in the hardware profile: "hbm"
    (the engine's own cache: no load), "dram", "disk" or "nvmeof".
    """
    channel_free: dict[str, float] = {}
    for request in sorted(requests, key=lambda r: r.arrival_s):
        request.ready_s = request.arrival_s
        for tier, tokens in request.hits.items():
            if tokens and tier_paths[tier] != "hbm":
                start = max(request.arrival_s, channel_free.get(tier, 0.0))
                done = start + hw.latency_s + tokens * model.kv_bytes_per_token / (
                    hw.tier_gbps(tier_paths[tier]) * 1e9)
                channel_free[tier] = done
                request.ready_s = max(request.ready_s, done)
        request.computed = sum(request.hits.values())
    pending = [(r.ready_s, i, r) for i, r in enumerate(requests)]
    heapq.heapify(pending)
    waiting: deque[SimRequest] = deque()
    running: list[SimRequest] = []
    now = 0.0
    while pending or waiting or running:
        while pending and pending[0][0] <= now:
            waiting.append(heapq.heappop(pending)[2])
        if not waiting and not running:
            now = pending[0][0]  # idle until the next request is ready
            continue
        room = budget - len(running)
        chunks, finishing = [], []
        for request in waiting:
            if room <= 0:
                break
            n = min(room, request.prompt_tokens - request.computed)
            chunks.append((request, n))
            room -= n
        now += step_seconds(model, hw, [(r.computed, n) for r, n in chunks], len(running))
        for request in running:
            request.decoded += 1
        running = [r for r in running if r.decoded < r.output_tokens]
        for request, n in chunks:
            request.computed += n
            if request.computed >= request.prompt_tokens:
                finishing.append(request)
        for request in finishing:
            waiting.remove(request)
            request.first_token_s = now
            request.decoded = 1
            if request.decoded < request.output_tokens:
                running.append(request)
    ttfts = sorted(r.first_token_s - r.arrival_s for r in requests if r.first_token_s is not None)
    makespan = now - min(r.arrival_s for r in requests)
    return {"ttft_p50_s": statistics.median(ttfts),
            "ttft_p90_s": ttfts[min(len(ttfts) - 1, round(0.9 * (len(ttfts) - 1)))],
            "throughput_tokens_per_s": sum(r.output_tokens for r in requests) / max(makespan, 1e-9)}
