"""Recompute vs load, estimated for hardware you do not have.

Formulas (n = context tokens; all rates are sustained, not peak, via `mfu`/`efficiency`):
  prefill_s(n)  = (2 * P * n + 2 * L * n^2 * A) / (F * mfu)
      P: parameters, L: layers, A: heads x head_dim (attention width), F: dense
      bf16 FLOP/s. 2*P*n is the weight matmuls, 2*L*n^2*A the causal QK^T and AV.
  kv_bytes(n)   = n * 2 * L * kv_heads * head_dim * dtype_bytes
  load_s(n, t)  = latency_t + kv_bytes(n) / bandwidth_t
      bandwidth_t is the narrowest link on tier t's path into HBM: host DRAM crosses
      PCIe; local NVMe is min(drives x drive bandwidth, PCIe); NVMe-oF is min(NIC, PCIe).
  crossover     = the smallest context (searched on a 1.05x grid from 16 tokens up to
                  the largest context asked for) from which load_s < prefill_s.
Prefill grows faster than linearly in n, a load linearly: past the crossover, loading
wins by more the longer the context.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvstore.format.errors import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelSpec:
        """From a Hugging Face config.json (or the directory holding it)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError("--model", str(path), "no config.json there")
        config = json.loads(file.read_text())
        try:
            hidden, layers = config["hidden_size"], config["num_hidden_layers"]
            heads = config["num_attention_heads"]
            kv_heads = config.get("num_key_value_heads", heads)
            head_dim = config.get("head_dim") or hidden // heads
            inter, vocab = config["intermediate_size"], config["vocab_size"]
        except KeyError as exc:
            raise ConfigError("--model", str(file), f"config.json lacks {exc}") from None
        per_layer = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 3 * hidden * inter
        embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
        dtype = str(config.get("torch_dtype", "bfloat16"))
        return cls(name=file.parent.name, params=float(layers * per_layer + embeddings),
                   layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   dtype_bytes=4 if "32" in dtype else 2)


# Published configs (config.json of each model on Hugging Face).
MODELS = {
    "llama-3.1-8b": ModelSpec("llama-3.1-8b", 8.03e9, 32, 32, 8, 128),
    "llama-3.1-70b": ModelSpec("llama-3.1-70b", 70.6e9, 80, 64, 8, 128),
    "qwen2.5-32b": ModelSpec("qwen2.5-32b", 32.8e9, 64, 40, 8, 128),
}


def model_spec(name_or_path: str) -> ModelSpec:
    """A preset by name, or a Hugging Face config.json (or its directory)."""
    return MODELS[name_or_path] if name_or_path in MODELS else ModelSpec.from_hf_config(name_or_path)


@dataclass(frozen=True)
class HardwareProfile:
    """Per GPU. Bandwidths in GB/s (1e9 bytes/s); `source` says where the figures come from."""

    name: str
    bf16_tflops: float
    hbm_gbps: float
    pcie_gbps: float
    dram_gbps: float
    nvme_gbps: float  # all local drives together
    nvmeof_gbps: float  # the fabric NIC share of one GPU
    source: str
    mfu: float = 0.5  # fraction of peak FLOP/s a long prefill sustains
    efficiency: float = 0.8  # fraction of link bandwidth a transfer sustains
    latency_s: float = 0.0005  # per load: request, first byte, launch

    def tier_gbps(self, tier: str) -> float:
        pcie = self.pcie_gbps
        paths = {"dram": min(self.dram_gbps, pcie), "disk": min(self.nvme_gbps, pcie),
                 "nvmeof": min(self.nvmeof_gbps, pcie), "hbm": self.hbm_gbps}
        if tier not in paths:
            raise ConfigError("--modes", tier, f"unknown tier (known: {', '.join(paths)})")
        return paths[tier] * self.efficiency


PROFILES = {
    "h100": HardwareProfile(
        "H100 SXM5", 989, 3350, 64, 200, 4 * 7.0, 50,
        "NVIDIA H100 datasheet (989 TFLOP/s dense BF16, 3.35 TB/s HBM3); PCIe Gen5 x16 64 GB/s; "
        "4 PCIe Gen4 NVMe drives at 7 GB/s; a 400 Gb/s NIC per GPU for NVMe-oF"),
    "h200": HardwareProfile(
        "H200 SXM", 989, 4800, 64, 200, 4 * 7.0, 50,
        "NVIDIA H200 datasheet (989 TFLOP/s dense BF16, 4.8 TB/s HBM3e); PCIe Gen5 x16 64 GB/s; "
        "4 Gen4 NVMe drives; 400 Gb/s NIC per GPU"),
    "mi300x": HardwareProfile(
        "MI300X", 1307, 5300, 64, 200, 4 * 7.0, 50,
        "AMD Instinct MI300X datasheet (1307 TFLOP/s dense BF16, 5.3 TB/s HBM3); PCIe Gen5 x16; "
        "4 Gen4 NVMe drives; 400 Gb/s NIC per GPU"),
    "rtx4090": HardwareProfile(
        "RTX 4090", 165, 1008, 32, 60, 7.0, 12.5,
        "NVIDIA Ada Lovelace whitepaper (165 TFLOP/s dense BF16 with FP32 accumulate, "
        "1008 GB/s GDDR6X); PCIe Gen4 x16 32 GB/s; one Gen4 NVMe drive; 100 Gb/s NIC"),
}


def prefill_s(model: ModelSpec, hw: HardwareProfile, tokens: int) -> float:
    flops = 2 * model.params * tokens + 2 * model.layers * tokens**2 * model.heads * model.head_dim
    return flops / (hw.bf16_tflops * 1e12 * hw.mfu)


def load_s(model: ModelSpec, hw: HardwareProfile, tokens: int, tier: str) -> float:
    return hw.latency_s + tokens * model.kv_bytes_per_token / (hw.tier_gbps(tier) * 1e9)


def estimate(model: ModelSpec, hw: HardwareProfile, contexts: list[int],
             tiers: list[str]) -> dict[str, Any]:
    """TTFT per mode and context (recompute, or load from a tier), and each tier's crossover."""
    results = []
    for context in contexts:
        results.append({"mode": "recompute", "context_tokens": context,
                        "ttft_s": prefill_s(model, hw, context)})
        results.extend({"mode": tier, "context_tokens": context,
                        "ttft_s": load_s(model, hw, context, tier) + prefill_s(model, hw, 1)}
                       for tier in tiers)
    grid: list[int] = []
    point = 16.0
    while point <= max(contexts):
        grid.append(int(point))
        point *= 1.05
    crossover = {}
    for tier in tiers:
        wins = [n for n in grid if load_s(model, hw, n, tier) < prefill_s(model, hw, n)]
        crossover[tier] = min(wins) if wins else None
    return {"model": asdict(model), "hardware": asdict(hw),
            "kv_bytes_per_token": model.kv_bytes_per_token, "results": results,
            "crossover_context": crossover}
