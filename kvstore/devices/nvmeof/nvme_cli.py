"""`nvme connect` / `nvme disconnect` command lines built from the config, and running them.

Operators keep one source of truth: the same `tiers.nvmeof` block that kvstore reads
also says how this host connects. Namespaces that share a subsystem connection
(transport, address, port, NQN, host NQN) share one `nvme connect`.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from kvstore.config.nvmeof import NamespaceConfig, NvmeofConfig
from kvstore.devices.nvmeof.sysfs import fabrics_available, resolve
from kvstore.format.errors import KVStoreError

_COMMAND_TIMEOUT_S = 60.0
# config field -> nvme-cli long option (nvme-cli spells this one with underscores)
_OPTIONAL_FLAGS = (("hostnqn", "--hostnqn"), ("nr_io_queues", "--nr-io-queues"),
                   ("queue_size", "--queue-size"), ("ctrl_loss_tmo", "--ctrl-loss-tmo"),
                   ("reconnect_delay", "--reconnect-delay"), ("fast_io_fail_tmo", "--fast_io_fail_tmo"))


class NvmeCliError(KVStoreError):
    """nvme-cli is missing, the kernel lacks the transport, or a command failed."""


@dataclass(frozen=True)
class Step:
    """One nvme-cli invocation, or the reason it is skipped."""

    argv: tuple[str, ...]
    skip_reason: str = ""


def _first_per_connection(config: NvmeofConfig) -> list[NamespaceConfig]:
    seen: dict[tuple[object, ...], NamespaceConfig] = {}
    for ns in config.namespaces:
        seen.setdefault(ns.connection, ns)
    return list(seen.values())


def connect_argv(ns: NamespaceConfig) -> tuple[str, ...]:
    argv = ["nvme", "connect", f"--transport={ns.transport}", f"--traddr={ns.traddr}",
            f"--trsvcid={ns.trsvcid}", f"--nqn={ns.subnqn}"]
    argv += [f"{flag}={getattr(ns, name)}" for name, flag in _OPTIONAL_FLAGS
             if getattr(ns, name) is not None]
    return tuple(argv)


def connect_plan(config: NvmeofConfig) -> list[Step]:
    """One `nvme connect` per connection; skipped where a live controller already serves
    every namespace behind it (connecting twice makes a second, duplicate controller)."""
    steps = []
    for first in _first_per_connection(config):
        behind = [ns for ns in config.namespaces if ns.connection == first.connection]
        resolved = [resolve(ns, config.sysfs_root, config.dev_root) for ns in behind]
        if all(r is not None and r.live for r in resolved):
            steps.append(Step(connect_argv(first), "already connected and live"))
        else:
            steps.append(Step(connect_argv(first)))
    return steps


def disconnect_plan(config: NvmeofConfig) -> list[Step]:
    """One `nvme disconnect --nqn` per subsystem (it drops every controller of that NQN
    on this host)."""
    nqns = dict.fromkeys(ns.subnqn for ns in config.namespaces)
    return [Step(("nvme", "disconnect", f"--nqn={nqn}")) for nqn in nqns]


def preflight(config: NvmeofConfig) -> None:
    """Fail with what to install or load before any command runs."""
    if shutil.which("nvme") is None:
        raise NvmeCliError("nvme-cli not found on PATH: install it (apt install nvme-cli, "
                           "dnf install nvme-cli) or use --dry-run to print the commands")
    for transport in sorted({ns.transport for ns in config.namespaces}):
        ok, why = fabrics_available(transport, config.sysfs_root)
        if not ok:
            raise NvmeCliError(why)


def execute(steps: list[Step]) -> None:
    for step in steps:
        if step.skip_reason:
            continue
        try:
            done = subprocess.run(step.argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S,
                                  check=False)
        except subprocess.TimeoutExpired:
            raise NvmeCliError(f"{' '.join(step.argv)}: no answer in {_COMMAND_TIMEOUT_S:.0f} s") from None
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
            raise NvmeCliError(f"{' '.join(step.argv)} failed: {detail}")
