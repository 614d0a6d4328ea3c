"""The package as a user gets it: installed without extras into a fresh virtualenv (no
editable install, no PYTHONPATH, run from outside the checkout), its commands still run.
This is what catches a module imported by the core but not declared in pyproject.toml."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.services import service_config, write_config

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"  # scripts/setup.sh's CPU wheel: a plain `torch` would pull a CUDA build


def _run(args: list[str], cwd: Path, timeout: float) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _share_torch(venv: Path, into: Path) -> bool:
    """The checkout's own CPU torch (scripts/setup.sh's wheel, unpacked) made visible to
    `venv` alone, without the rest of the checkout's packages: a folder of links to torch
    and its metadata only, named by a .pth file. pip sees torch installed and installs
    whatever else the package and torch declare. False where there is none to share."""
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    names = ["torch", "functorch", "torchgen", *(p.name for p in site.glob("torch-*.dist-info"))]
    if not all((site / name).exists() for name in names) or len(names) != 4:
        return False
    into.mkdir()
    for name in names:
        (into / name).symlink_to(site / name)
    (lib,) = (venv / "lib").glob("python3*")
    (lib / "site-packages" / "checkout-torch.pth").write_text(f"{into}\n")
    return True


@pytest.mark.slow
def test_the_package_without_extras_runs_its_commands(tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, 120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    if shutil.which("nvidia-smi") is None and not _share_torch(venv, tmp_path / "torch"):
        _run([*pip, TORCH], tmp_path, 600)
    source = tmp_path / "source"  # a copy without build leftovers or the checkout's virtualenvs
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv*", ".git", "__pycache__", "*.egg-info",
                                                                  "build", ".benchmarks", ".*_cache"))
    _run([*pip, str(source)], tmp_path, 600)
    kvstore = str(venv / "bin" / "kvstore")
    assert "disk-tier directory" in _run([kvstore, "fsck", "--help"], tmp_path, 120)
    disk = tmp_path / "disk"
    config = tmp_path / "kvstore.yaml"
    write_config(config, service_config(tmp_path, dram="64MiB", disk_dir=str(tmp_path), disk="64MiB",
                                        socket="run/kv.sock", staging=None))
    info = _run([kvstore, "info", "--config", str(config), "--chunk-size", "1MiB"], tmp_path, 120)
    assert str(disk) in info, info
    bench = _run([kvstore, "bench", "--total", "64MiB", "--path", str(tmp_path / "bench"), "--no-fio"],
                 tmp_path, 600)
    assert "uring-service" in bench and "lookup of" in bench, bench
