"""Runs a real vLLM engine in a fresh process (bench.engine_run) and reads its result."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvstore.client import ServiceUnavailable, StoreClient
from kvstore.config import load_config

ENGINE_TIMEOUT_S = 300
RESULT_PREFIX = "KVSTORE_RESULT "


@dataclasses.dataclass
class EngineRun:
    returncode: int
    output: str
    results: list[dict[str, Any]]


def run_engine(model: str | Path, prompts_file: str | Path, connector: dict[str, Any] | None = None,
               *, single_process: bool = True, max_num_batched_tokens: int | None = None,
               expect_ok: bool = True) -> EngineRun:
    command = [sys.executable, "-m", "bench.engine_run", "--model", str(model),
               "--prompts", str(prompts_file)]
    if connector is not None:
        command += ["--connector", json.dumps(connector)]
    if single_process:
        command.append("--single-process")
    if max_num_batched_tokens:
        command += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S, env=env,
                          cwd=Path(__file__).resolve().parent.parent)
    output = done.stdout + done.stderr
    results = []
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            results = json.loads(line[len(RESULT_PREFIX):])["results"]
    if expect_ok and (done.returncode != 0 or not results):
        raise AssertionError(f"engine run failed (rc={done.returncode}):\n{output[-4000:]}")
    return EngineRun(done.returncode, output, results)


def service_client(store_config: dict[str, Any]) -> StoreClient:
    """A lookup-only client of an already running service (never starts one)."""
    config = load_config(store_config)
    config = dataclasses.replace(config, service=dataclasses.replace(config.service, spawn=False))
    return StoreClient(config)


def stop_service(store_config: dict[str, Any]) -> None:
    with contextlib.suppress(ServiceUnavailable):
        service_client(store_config).shutdown()
