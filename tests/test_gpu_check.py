"""scripts/gpu_check.sh on a machine without CUDA: it runs, lists every `cuda` test it
found as skipped, reports each GPU item skipped, writes its JSON and exits 0. Its verdicts
are also fed failing input, so they can fail."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.lab import gpu_check

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, run scripts/gpu_check.sh itself (minutes)")
def test_the_gpu_check_runs_on_cpu_with_every_gpu_item_skipped(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--json", str(out)],
                          env={**os.environ, "KVSTORE_PYTHON": sys.executable}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["device"] is None
    rows = {row["item"]: row for row in result["rows"]}
    assert {row["status"] for row in rows.values()} == {"skipped"}, rows
    assert {gpu_check.LOAD_PATH, gpu_check.VLLM, gpu_check.TIER} <= set(rows)
    assert set(gpu_check.LABELS.values()) <= {item.split(" (")[0] for item in rows}, rows
    cuda_tests = [item for item in rows if item not in (gpu_check.LOAD_PATH, gpu_check.VLLM, gpu_check.TIER)]
    assert len(cuda_tests) >= 3, rows
    for row in rows.values():
        assert re.search(rf"^{re.escape(row['item'])} +skipped ", done.stdout, re.M), done.stdout


def _turn(answer: str, cached: int) -> dict:
    return {"answer": answer, "cached_tokens": cached}


def test_the_vllm_verdict_needs_equal_answers_and_loads_after_the_restart():
    good = {"recompute": [_turn("a", 0), _turn("b", 0)], "dram": [_turn("a", 0), _turn("b", 256)],
            "disk": [_turn("a", 256), _turn("b", 512)]}
    assert gpu_check.demo_verdict(good, 0)[0] == "pass"
    assert gpu_check.demo_verdict(good, 1) == ("fail", None, "greedy answers differ")
    different = {**good, "disk": [_turn("a", 256), _turn("c", 512)]}
    assert gpu_check.demo_verdict(different, 0)[2] == "greedy answers differ"
    cold = {**good, "disk": [_turn("a", 0), _turn("b", 512)]}
    assert gpu_check.demo_verdict(cold, 0)[2] == "the restarted engine did not load every turn"


def test_the_tier_verdict_needs_equal_answers_and_a_load_by_the_fresh_server():
    assert gpu_check.tier_verdict([[1, 2], [1, 2]], [0, 512])[0] == "pass"
    assert gpu_check.tier_verdict([[1, 2], [1, 3]], [0, 512])[2] == "greedy answers differ"
    assert gpu_check.tier_verdict([[1, 2], [1, 2]], [0, 0])[2] == "the fresh server loaded nothing"


def test_a_failed_or_missing_cuda_test_is_a_failed_row(tmp_path):
    report = tmp_path / "report.xml"
    report.write_text('<testsuites><testsuite><testcase classname="tests.test_leases" name="test_x">'
                      '<failure message="boom"/></testcase></testsuite></testsuites>')
    assert gpu_check._junit_rows(report) == [gpu_check.Row("cuda test test_leases.py::test_x", "fail",
                                                            note="boom")]
