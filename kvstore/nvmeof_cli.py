"""`kvstore nvmeof connect|disconnect|status`: one config drives nvme-cli and the tier."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from kvstore.config.nvmeof import NvmeofConfig
from kvstore.config.store import StoreConfig, load_config
from kvstore.devices.nvmeof.nvme_cli import Step, connect_plan, disconnect_plan, execute, preflight
from kvstore.devices.nvmeof.sysfs import resolve
from kvstore.format.errors import ConfigError
from kvstore.service.client import service_info


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    for name, text in (("connect", "nvme connect every subsystem the config names"),
                       ("disconnect", "nvme disconnect every subsystem the config names"),
                       ("status", "each namespace's device, controllers and tier health")):
        action = actions.add_parser(name, help=text)
        action.add_argument("--config", required=True, help="kvstore config with tiers.nvmeof")
        action.add_argument("--sysfs-root", help="read this sysfs tree instead of the config's")
        if name == "status":
            action.add_argument("--json", action="store_true")
        else:
            action.add_argument("--dry-run", action="store_true",
                                help="print the nvme command lines instead of running them")


def _configs(args: argparse.Namespace) -> tuple[StoreConfig, NvmeofConfig]:
    config = load_config(args.config)
    if config.nvmeof is None:
        raise ConfigError("tiers.nvmeof", None, f"{args.config} has no nvmeof tier")
    nvmeof = config.nvmeof
    if args.sysfs_root:
        nvmeof = nvmeof.model_copy(update={"sysfs_root": args.sysfs_root})
    return config, nvmeof


def _print_steps(steps: list[Step]) -> None:
    for step in steps:
        line = " ".join(step.argv)
        print(f"# {line}   (skipped: {step.skip_reason})" if step.skip_reason else line)


def status(config: StoreConfig, nvmeof: NvmeofConfig) -> dict[str, Any]:
    """What this host sees of each namespace, plus the running service's view of it."""
    devices = _service_devices(config)
    rows = []
    for ns in nvmeof.namespaces:
        found = resolve(ns, nvmeof.sysfs_root, nvmeof.dev_root)
        row: dict[str, Any] = {"label": ns.label, "subnqn": ns.subnqn, "nsid": ns.nsid, "uuid": ns.uuid,
                               "device": None, "state": "not connected", "transport": ns.transport,
                               "address": f"traddr={ns.traddr},trsvcid={ns.trsvcid}",
                               "logical_block_size": None, "controllers": [], "tier": None}
        if found is not None:
            live = [c for c in found.controllers if c.state == "live"] or list(found.controllers)
            row.update(device=found.device, state=found.state,
                       logical_block_size=found.logical_block_size,
                       controllers=[dataclasses.asdict(c) for c in found.controllers])
            if live:
                row.update(transport=live[0].transport, address=live[0].address)
            row["tier"] = devices.get(found.device) if devices is not None else "no service running"
        rows.append(row)
    return {"namespaces": rows}


def _service_devices(config: StoreConfig) -> dict[str, Any] | None:
    """Device path -> health as the running service sees it; None without a service."""
    info = service_info(config)
    if info is None:
        return None
    return {d["path"]: {k: d[k] for k in ("state", "reason", "faults", "trips")}
            for tier in info.get("tiers", []) for d in tier.get("devices", [])}


def run(args: argparse.Namespace) -> int:
    config, nvmeof = _configs(args)
    if args.action == "status":
        report = status(config, nvmeof)
        if args.json:
            print(json.dumps(report, indent=2))
            return 0
        for row in report["namespaces"]:
            tier = row["tier"]
            health = tier if isinstance(tier, str) or tier is None else (
                f"{tier['state']}{' (' + tier['reason'] + ')' if tier['reason'] else ''}")
            print(f"{row['label']}: {row['device'] or '-'} {row['state']} {row['transport']} "
                  f"{row['address']}  tier: {health or '-'}")
        return 0 if all(r["state"] == "live" for r in report["namespaces"]) else 1
    steps = connect_plan(nvmeof) if args.action == "connect" else disconnect_plan(nvmeof)
    if args.dry_run:
        _print_steps(steps)
        return 0
    preflight(nvmeof)
    execute(steps)
    _print_steps(steps)
    return 0
