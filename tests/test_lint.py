"""CI runs the code's own checks before the tests: `.ci/run` is README's test command,
ruff and mypy first, so a finding of either fails the run (they are not run again here)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readmes_command_with_ruff_and_mypy_before_the_tests():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci
    command = ci.strip().splitlines()[-1]
    readme = re.search(r"\*\*Run the tests\*\*.*?\n\n    (.+?)\n", (ROOT / "README.md").read_text(), re.S)
    assert readme is not None and readme.group(1) == command, (readme, command)
    steps = [step.strip() for step in command.split("&&")]
    assert steps == ["bash scripts/setup.sh", ".venv/bin/python -m ruff check .", ".venv/bin/python -m mypy",
                     ".venv/bin/python -m pytest -q -n 2"], steps
