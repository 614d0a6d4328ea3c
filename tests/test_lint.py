"""The code's own checks run with the tests, so CI fails on them too: ruff (style,
imports, likely bugs) and mypy (types, with pydantic's plugin) over the packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("tool", [["ruff", "check", "."], ["mypy"]], ids=["ruff", "mypy"])
def test_the_code_passes(tool):
    done = subprocess.run([sys.executable, "-m", *tool], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
