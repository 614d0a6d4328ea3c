"""Tests that drive a real vLLM engine: a fresh engine run, vLLM's bar for "the same
answer" (the service those engines use: support/services.py), and an image as vLLM's
processor hands it to the engine core."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.support.answers import Answer, Tokens, compare
from bench.support.engine_run import EngineRun, run_fresh


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


def processed_image(seed: int) -> Any:
    """A processed image as vLLM's processor hands it on (a `MultiModalKwargsItem` holding
    its `pixel_values`), its values drawn from `seed`."""
    import torch
    from vllm.multimodal.inputs import MultiModalBatchedField, MultiModalFieldElem, MultiModalKwargsItem

    values = torch.Generator().manual_seed(seed)
    return MultiModalKwargsItem({"pixel_values": MultiModalFieldElem(
        data=torch.rand(3, 8, 8, generator=values), field=MultiModalBatchedField())})
