"""What a run of kvstore on a real engine sets up, shared by the `kvstore` commands and the
experiments: its work directory (the user's, kept, or a temporary one), the store config
its service gets, the vLLM server arguments the real chat model is served with, and
waiting until that service holds what an engine stored."""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvstore.config.store import load_config
from kvstore.service.client import service_info

CHUNK = 256  # tokens per chunk of default_config's store, which the demo's bounds count in


def server_args(dtype: str) -> list[str]:
    """vLLM's OpenAI server for the chat model, served as `chat`, its own prefix cache off."""
    return ["--dtype", dtype, "--enable-prompt-tokens-details", "--max-model-len", "8192",
            "--enforce-eager", "--no-enable-prefix-caching", "--served-model-name", "chat"]


SERVER_ARGS = server_args("float16")


def default_config(workdir: Path, disk_capacity: str = "4GiB") -> dict[str, Any]:
    """A DRAM tier over a disk tier in `workdir`, its service's socket there too."""
    return {"chunk_tokens": CHUNK,
            "tiers": {"dram": {"capacity": "2GiB"},
                      "disk": [{"path": str(workdir / "disk"), "capacity": disk_capacity}]},
            "service": {"socket": str(workdir / "kvstore.sock")}}


@contextlib.contextmanager
def run_workdir(path: str | None, prefix: str, parent: str | None = None) -> Iterator[Path]:
    """The user's --workdir, kept; else a temporary one, removed with its disk tier at the end.

    The disk tier reserves its whole capacity, so a run that left its temporary
    directory behind would cost that much disk every time it ran. `parent`: where the
    temporary one goes (default: the system's temporary directory).
    """
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix=prefix, dir=parent) as temp:
        yield Path(temp)


def wait_held(store: dict[str, Any], chunks: int, timeout_s: float = 120, *, tier: str = "dram") -> int:
    """Wait until the kvstore service of `store` holds `chunks` chunks in `tier` (an engine
    stores them behind its answers); the count there when it does or the deadline passes.
    SGLang's pages are counted in the DRAM tier (write-through copies that find the disk
    queue full go down only when evicted, and `kvstore stop` drains DRAM to disk);
    LMCache's store controller hands its chunks on to the disk tier."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = service_info(load_config(store)) or {}
        held = sum(int(t["chunks"]) for t in info.get("tiers", ()) if t["name"] == tier)
        if held >= chunks or time.monotonic() > deadline:
            return held
        time.sleep(0.5)
