"""Helpers for tests that drive a real vLLM engine and the kvstore service."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.support.answers import Answer, Tokens, compare
from engine_plugin.engine_run import EngineRun, run_fresh
from kvstore.config.store import load_config
from kvstore.service.client import StoreClient, attach
from kvstore.service.client import stop_service as _stop


def run_engine(model: str | Path, prompts_file: str | Path, connector: dict[str, Any] | None = None,
               *, single_process: bool = True, max_num_batched_tokens: int | None = None,
               module_path: bool = False, expect_ok: bool = True, kv_events: str | None = None,
               dtype: str = "float16") -> EngineRun:
    """A fresh engine process; single-process by default because it starts fastest."""
    return run_fresh(model, prompts_file, connector, single_process=single_process,
                     max_num_batched_tokens=max_num_batched_tokens, module_path=module_path,
                     timeout_s=300, check=expect_ok, kv_events=kv_events, dtype=dtype)


def assert_close(expected: Answer | dict[str, Any], got: Answer | dict[str, Any],
                 what: str = "kvstore") -> None:
    """`got` answers as `expected` by vLLM's bar (bench/support/answers.py): the same greedy tokens, or
    a near-tie at the first difference. Engine-run results (dicts) or replies."""
    found = compare(_answer(expected), _answer(got), ("reference", what))
    assert found.close, found.describe()


def _answer(answer: Answer | dict[str, Any]) -> Answer:
    return Tokens.of(answer) if isinstance(answer, dict) else answer


def service_client(store_config: dict[str, Any]) -> StoreClient:
    return attach(load_config(store_config))


def counters(store_config: dict[str, Any]) -> dict[str, int]:
    """The running service's counters."""
    client = service_client(store_config)
    try:
        return client.info()["counters"]
    finally:
        client.close()


def stop_service(store_config: dict[str, Any]) -> None:
    _stop(load_config(store_config))


def small_service_config(tmp_path: Path, disk_dir: str) -> dict[str, Any]:
    """A service of its own for an engine backend's test: 8 MiB of DRAM over a 32 MiB disk
    tier, a short I/O deadline, its socket under `tmp_path`."""
    return {"tiers": {"host": {"capacity": "8MiB"},
                      "disk": [{"path": str(Path(disk_dir) / "disk"), "capacity": "32MiB"}]},
            "io": {"timeout_s": 0.5},
            "service": {"socket": str(tmp_path / "run" / "kvstore.sock"), "staging": "2MiB"}}


@contextmanager
def small_service(tmp_path: Path, disk_dir: str) -> Iterator[dict[str, Any]]:
    """small_service_config's config, its service (spawned by the first engine) stopped after."""
    config = small_service_config(tmp_path, disk_dir)
    try:
        yield config
    finally:
        stop_service(config)


def wait_for_log(path: Path, text: str, after: int = 0, timeout_s: float = 30) -> str:
    """The log at `path` from character `after` on, once `text` is in it (AssertionError
    with what it holds after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = path.read_text(errors="replace")
        if text in log[after:]:
            return log[after:]
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in the log: {path.read_text(errors='replace')[after:]}")
