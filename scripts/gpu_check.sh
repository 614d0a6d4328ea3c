#!/usr/bin/env bash
# Everything that needs a GPU in one command, at most 8 minutes, after README's setup
# (bench/lab/gpu_check.py says what it runs). Prints a table, writes it as JSON (--json,
# default gpu_check.json); on a machine without CUDA every GPU item is skipped, exit 0.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${KVSTORE_PYTHON:-.venv/bin/python}" -m bench.lab gpu_check "$@"
