"""The experiments' runner, `python -m bench.lab`, run as a user runs it: its --help lists
every experiment of bench/lab/ (one line each), an experiment gets the common flags
(--workdir kept, --json written, the table printed), and one this machine cannot run
exits 2 saying why."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.support.processes import paused_group, process_cpu, start_group, stop_group

ROOT = Path(__file__).resolve().parent.parent


def _lab(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-m", "bench.lab", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120)


def _experiments() -> set[str]:
    """The modules of bench/lab/ that define experiment(args, workdir)."""
    found = set()
    for path in (ROOT / "bench" / "lab").glob("*.py"):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.FunctionDef) and n.name == "experiment" for n in tree.body):
            found.add(path.stem)
    return found


def test_help_lists_every_experiment_with_one_line():
    done = _lab("--help")
    assert done.returncode == 0, done.stderr
    listed = re.findall(r"^    (\w+)", done.stdout, re.M)
    assert sorted(listed) == sorted(_experiments()) and len(listed) >= 12, done.stdout
    unknown = _lab("nothing-such")
    assert unknown.returncode == 2 and "invalid choice: 'nothing-such'" in unknown.stderr


def test_an_experiment_takes_the_common_flags(tmp_path):
    out, kept = tmp_path / "result.json", tmp_path / "kept"
    done = _lab("weights_cost", str(tmp_path / "ckpt"), "--shards", "1", "--gib", str(1 / 256),
                "--workdir", str(kept), "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "first hash" in done.stdout and json.loads(out.read_text())["cached_files_read"] == 0
    assert kept.is_dir() and not (tmp_path / "ckpt").exists()


def test_an_experiment_this_machine_cannot_run_exits_2_saying_why():
    done = _lab("index_load", "--chunks", "10", "--lookup-keys", "60")
    assert done.returncode == 2
    assert done.stderr.startswith("python -m bench.lab index_load: "), done.stderr


def test_save_path_prints_each_mode_against_the_floor(tmp_path):
    out = tmp_path / "save.json"
    done = _lab("save_path", "--chunk-mib", "1", "--dram-chunks", "8", "--wave", "2", "--saves", "3",
                "--gap-s", "0.05", "--rounds", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr
    best = json.loads(out.read_text())["best"]
    assert list(best) == ["free DRAM (floor)", "cleaner", "no cleaner"]
    assert best["no cleaner"]["demoted"] > 0 and best["no cleaner"]["cleaned"] == 0
    assert "x floor" in done.stdout


def _cpu_grows(pid: int, by_s: float, within_s: float = 20.0) -> bool:
    start, deadline = process_cpu(pid), time.monotonic() + within_s
    while time.monotonic() < deadline:
        if process_cpu(pid) - start >= by_s:
            return True
        time.sleep(0.05)
    return False


def test_a_paused_server_group_takes_no_cpu_from_the_one_timed_and_goes_on_after(tmp_path):
    """The TTFT bench stops the server not timed (an idle vLLM server's worker spins on a
    core); its CPU is read from the process's CPU clock, which goes on at once after."""
    spinner = start_group([sys.executable, "-c", "while True: pass"], tmp_path / "spin.log", dict(os.environ))
    try:
        assert _cpu_grows(spinner.pid, 0.05)
        with paused_group(spinner.pid):
            stopped = process_cpu(spinner.pid)
            time.sleep(0.5)
            assert process_cpu(spinner.pid) - stopped < 0.01
        assert _cpu_grows(spinner.pid, 0.05)
    finally:
        stop_group(spinner, timeout_s=5)


def test_the_piece_hash_bench_compares_two_updates_that_agree(tmp_path):
    """bench/lab/piece_hash.py (the figures in docs/benchmarks.md): both of the C library's
    updates give the same digest (else its comparison would be void), each a speed."""
    out = tmp_path / "hash.json"
    done = _lab("piece_hash", "--mib", "4", "--rounds", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr
    found = json.loads(out.read_text())
    assert found["same_digest"] is True, found
    assert min(found["XXH3_64bits_update"], found["XXH3_64bits_update_dispatch"], found["copy"]) > 0
    assert "dispatched update" in done.stdout
