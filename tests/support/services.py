"""The kvstore service in tests: one builder of its config (every test that starts a
service, or lets an engine spawn one, writes its config through `service_config`), and a
running service's client, counters, log and stop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from kvstore.config.store import load_config
from kvstore.service.client import StoreClient, attach
from kvstore.service.client import stop_service as _stop


def service_config(folder: Path | str, *, dram: int | str | None = None, disk_dir: str | None = None,
                   disk: int | str | None = None, io: dict[str, Any] | None = None,
                   chunk_tokens: int | None = None, socket: str = "kvstore.sock",
                   staging: int | str | None = "1MiB", **service: Any) -> dict[str, Any]:
    """A service's config: its socket at `folder/socket` (`socket` may name a subfolder:
    "run/kvstore.sock"), a DRAM tier of `dram` bytes, a disk tier of `disk` bytes at
    `disk_dir/disk`, the `io` section as given, the service's `staging` window (None: the
    service's default) and its other keys (`spawn`, `allowed_uids`...). Neither `dram`
    nor `disk_dir`: no `tiers` key, for a caller that merges in tiers of its own."""
    assert (disk_dir is None) == (disk is None), "a disk tier needs both disk_dir and disk"
    config: dict[str, Any] = {}
    if chunk_tokens is not None:
        config["chunk_tokens"] = chunk_tokens
    tiers: dict[str, Any] = {}
    if dram is not None:
        tiers["dram"] = {"capacity": dram}
    if disk_dir is not None:
        tiers["disk"] = [{"path": os.path.join(disk_dir, "disk"), "capacity": disk}]
    if tiers:
        config["tiers"] = tiers
    if io is not None:
        config["io"] = io
    section: dict[str, Any] = {"socket": os.path.join(folder, socket)}
    if staging is not None:
        section["staging"] = staging
    config["service"] = {**section, **service}
    return config


def write_config(path: Path, config: dict[str, Any]) -> Path:
    """`config` written to `path` as the service and `kvstore` read it: JSON for a .json
    file, YAML for any other."""
    path.write_text(json.dumps(config) if path.suffix == ".json" else yaml.safe_dump(config))
    return path


def small_service_config(tmp_path: Path, disk_dir: str) -> dict[str, Any]:
    """A service of its own for an engine backend's test: 8 MiB of DRAM over a 32 MiB disk
    tier, a short I/O deadline, its socket under `tmp_path`."""
    return service_config(tmp_path, dram="8MiB", disk_dir=disk_dir, disk="32MiB", io={"timeout_s": 0.5},
                          socket="run/kvstore.sock", staging="2MiB")


@contextmanager
def small_service(tmp_path: Path, disk_dir: str) -> Iterator[dict[str, Any]]:
    """small_service_config's config, its service (spawned by the first engine) stopped after."""
    config = small_service_config(tmp_path, disk_dir)
    try:
        yield config
    finally:
        stop_service(config)


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


@contextmanager
def serving(config_file: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`kvstore serve --config FILE` until the block ends (stopped by its owner, or killed)."""
    with open(log, "w") as out:
        command = [sys.executable, "-m", "kvstore.cli", "serve", "--config", str(config_file)]
        service = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_log(log, "listening")
        yield service
    finally:
        if service.poll() is None:
            service.kill()
            service.wait()
