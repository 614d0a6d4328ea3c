"""The chunked-prefill scheduler model on cases whose TTFT is known by hand."""

from __future__ import annotations

import pytest

from bench.sim.sched_model import SimRequest, simulate, step_seconds
from bench.sim.ttft_model import HardwareProfile, ModelSpec

MODEL = ModelSpec("m", params=1e6, layers=1, heads=1, kv_heads=1, head_dim=8)
# 1 TFLOP/s, no weight-read floor worth noticing, loads at 1 GB/s from "dram"
HW = HardwareProfile("x", bf16_tflops=1.0, hbm_gbps=1e9, pcie_gbps=1.0, dram_gbps=1.0, nvme_gbps=1.0,
                     nvmeof_gbps=1.0, source="test", mfu=1.0, efficiency=1.0, latency_s=0.001)


def step(prefill, decodes=0):
    return step_seconds(MODEL, HW, prefill, decodes)


def test_step_time_counts_weights_and_causal_attention():
    # 2*P*tokens + 2*L*A*sum(context): 100 tokens from position 0 see 1..100 tokens
    assert step([(0, 100)]) == pytest.approx((2e6 * 100 + 2 * 8 * 5050) / 1e12)
    assert step([], decodes=3) == pytest.approx(2e6 * 3 / 1e12)


def test_one_request_is_prefilled_in_budget_sized_chunks():
    request = SimRequest(arrival_s=5.0, prompt_tokens=250, output_tokens=1)
    result = simulate([request], MODEL, HW, {}, budget=100)
    expected = step([(0, 100)]) + step([(100, 100)]) + step([(200, 50)])
    assert request.first_token_s - 5.0 == pytest.approx(expected)
    assert result["ttft_p50_s"] == pytest.approx(expected)


def test_a_hit_is_loaded_first_then_only_the_rest_is_computed():
    request = SimRequest(0.0, prompt_tokens=250, output_tokens=1, hits={"dram": 200})
    simulate([request], MODEL, HW, {"dram": "dram"}, budget=100)
    load = 0.001 + 200 * MODEL.kv_bytes_per_token / 1e9
    assert request.first_token_s == pytest.approx(load + step([(200, 50)]))


def test_a_gpu_hit_costs_no_load():
    request = SimRequest(0.0, prompt_tokens=250, output_tokens=1, hits={"gpu": 200})
    simulate([request], MODEL, HW, {"gpu": "hbm"}, budget=100)
    assert request.first_token_s == pytest.approx(step([(200, 50)]))


def test_decodes_go_first_and_prefill_fills_the_rest():
    a = SimRequest(0.0, prompt_tokens=10, output_tokens=5)
    b = SimRequest(0.0, prompt_tokens=10, output_tokens=1)
    simulate([a, b], MODEL, HW, {}, budget=10)
    # step 1: a's whole prompt; step 2: a decodes, b gets 9 tokens; step 3: a decodes, b's last
    s1, s2, s3 = step([(0, 10)]), step([(0, 9)], decodes=1), step([(9, 1)], decodes=1)
    assert a.first_token_s == pytest.approx(s1)
    assert b.first_token_s == pytest.approx(s1 + s2 + s3)
