"""One round of an engine storage backend's benchmark (SGLang's HiCache, LMCache), the
kvstore service's CPU it used, and the table both benchmarks print against their baseline."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench.storage_cases import process_cpu
from kvstore.config.store import load_config
from kvstore.service.client import attach


@dataclass
class Round:
    backend: str
    hits: str
    gib_s: float
    cpu_s_per_gib: float
    verified: bool


def service_cpu(store: dict[str, Any]) -> float:
    """CPU seconds (user + system) the running kvstore service has used so far."""
    client = attach(load_config(store))
    try:
        pid = int(client.info()["service_pid"])
    finally:
        client.close()
    return process_cpu(pid)


def report(rounds: Sequence[Round], base: Callable[[Round], float], versus: str,
           json_path: str | None) -> None:
    """Print each round with its speed as a multiple of `base(round)` (the baseline measured
    in the same run), and write the rounds as JSON where asked."""
    width = max(len(r.backend) for r in rounds) + 2
    print(f"{'backend':<{width}} {'hits':<5} {'GiB/s':>7} {'CPU s/GiB':>10} {versus:>9}  verified")
    for r in rounds:
        print(f"{r.backend:<{width}} {r.hits:<5} {r.gib_s:7.2f} {r.cpu_s_per_gib:10.3f} "
              f"{r.gib_s / base(r):9.2f}  {r.verified}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump([asdict(r) for r in rounds], f, indent=1)
