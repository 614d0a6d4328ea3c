"""kvstore ttft: the estimate's formulas on known cases; the measure mode on the tiny model."""

from __future__ import annotations

import json

import pytest

from bench.sim.ttft_model import MODELS, PROFILES, HardwareProfile, ModelSpec, estimate, load_s, prefill_s
from bench.support.runs import run_workdir
from bench.support.tiny_model import build_tiny_llama
from kvstore.cli import main as cli_main
from kvstore.format.errors import ConfigError

FLAT = HardwareProfile("flat", bf16_tflops=1.0, hbm_gbps=1, pcie_gbps=2.0, dram_gbps=4.0,
                       nvme_gbps=1.0, nvmeof_gbps=8.0, source="test", mfu=1.0, efficiency=1.0,
                       latency_s=0.0)


def test_kv_bytes_per_token_of_a_published_model():
    # Llama 3.1 8B: 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes
    assert MODELS["llama-3.1-8b"].kv_bytes_per_token == 131072


def test_prefill_and_load_follow_the_documented_formulas():
    model = ModelSpec("m", params=1e6, layers=2, heads=4, kv_heads=2, head_dim=8)
    # 2*P*n + 2*L*n^2*heads*head_dim at 1 TFLOP/s
    assert prefill_s(model, FLAT, 100) == pytest.approx((2e6 * 100 + 2 * 2 * 100**2 * 32) / 1e12)
    per_token = 2 * 2 * 2 * 8 * 2
    assert load_s(model, FLAT, 1000, "dram") == pytest.approx(1000 * per_token / 2e9)  # PCIe-bound
    assert load_s(model, FLAT, 1000, "disk") == pytest.approx(1000 * per_token / 1e9)  # NVMe-bound
    assert load_s(model, FLAT, 1000, "nvmeof") == pytest.approx(1000 * per_token / 2e9)  # PCIe-bound


def test_crossover_is_where_loading_starts_to_win():
    # Compute grows with n^2, the load linearly plus a fixed latency: they cross once.
    slow_link = HardwareProfile("x", 1e-6, 1, 0.001, 0.001, 0.001, 0.001, "test", 1.0, 1.0, 1.0)
    model = ModelSpec("m", params=1e3, layers=1, heads=1, kv_heads=1, head_dim=64)
    result = estimate(model, slow_link, [4096], ["dram"])
    n = result["crossover_context"]["dram"]
    assert n is not None
    assert load_s(model, slow_link, n, "dram") < prefill_s(model, slow_link, n)
    assert load_s(model, slow_link, int(n / 1.06), "dram") >= prefill_s(model, slow_link, int(n / 1.06))


def test_every_profile_names_its_source():
    assert {"h100", "h200", "mi300x", "rtx4090"} <= set(PROFILES)
    assert all(profile.source for profile in PROFILES.values())


def test_model_spec_from_a_local_config(tmp_path):
    path = build_tiny_llama(tmp_path / "m", layers=3, hidden=128, heads=4, kv_heads=2)
    spec = ModelSpec.from_hf_config(path)
    assert (spec.layers, spec.heads, spec.kv_heads, spec.head_dim) == (3, 4, 2, 32)
    assert spec.kv_bytes_per_token == 2 * 3 * 2 * 32 * 2
    with pytest.raises(ConfigError, match=r"no config\.json"):
        ModelSpec.from_hf_config(tmp_path / "absent")


def test_estimate_cli_writes_json_and_plot(tmp_path):
    out = tmp_path / "est.json"
    assert cli_main(["ttft", "--estimate", "--hardware", "h200", "--contexts", "1024,8192",
                     "--modes", "recompute,dram,disk,nvmeof", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {r["mode"] for r in result["results"]} == {"recompute", "dram", "disk", "nvmeof"}
    assert out.with_suffix(".png").stat().st_size > 1000


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_measure_mode_on_the_tiny_model(tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "ttft.json"
    code = cli_main(["ttft", "--modes", "recompute,dram", "--contexts", "300,600", "--prompts", "1",
                     "--single-process", "--workdir", str(tmp_path), "--disk-capacity", "128MiB",
                     "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert code == 0
    assert {(r["mode"], r["context_tokens"]) for r in rows} == {
        (mode, n) for mode in ("recompute", "save", "dram") for n in (300, 600)}
    assert all(r["answers_close"] for r in rows)
    assert {r["context_tokens"]: r["loaded_tokens"] for r in rows if r["mode"] == "dram"} == {
        300: 256, 600: 512}
    assert {"ttft_p50_s", "ttft_p90_s"} <= set(rows[0])


def test_a_temporary_workdir_goes_with_its_disk_tier(tmp_path):
    with run_workdir(None, "kvstore-ttft-test-") as workdir:
        (workdir / "disk").write_bytes(b"reserved")
    assert not workdir.exists()
    with run_workdir(str(tmp_path / "kept"), "unused-") as workdir:
        (workdir / "disk").write_bytes(b"reserved")
    assert (tmp_path / "kept" / "disk").exists()
