"""The `kvstore` command: nvmeof, purge, fsck, info, serve, stop, and the commands other packages
register (bench: demo, bench, ttft, replay)."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import signal
import sys
import threading
from importlib.metadata import entry_points

from kvstore.format.errors import KVStoreError
from kvstore.format.units import format_size, parse_size
from kvstore.service.signal_flag import SignalFlag


def _fsck(args: argparse.Namespace) -> int:
    from kvstore.store.fsck import fsck

    counts = fsck(args.path)
    if args.json:
        print(json.dumps(counts))
    else:
        print(", ".join(f"{n} {name}" for name, n in counts.items()))
    return 1 if counts["corrupt"] else 0


def _info(args: argparse.Namespace) -> int:
    """From the running service when one answers (it holds the tiers' locks), else by
    opening the tiers directly, which needs their chunk size."""
    from kvstore.config.store import load_config
    from kvstore.service.client import service_info
    from kvstore.store.tiered import TieredStore

    config = load_config(args.config)
    info = service_info(config)
    if info is None:
        if not args.chunk_size:
            print(f"kvstore: no service at {config.service.socket}; give --chunk-size to open "
                  "the tiers directly", file=sys.stderr)
            return 2
        with TieredStore(config, parse_size(args.chunk_size)) as store:
            info = store.info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    if "chunk_bytes" not in info:
        print(f"service at {info['socket']} (pid {info['service_pid']}): no engine has connected yet")
        for name, value in sorted(info["counters"].items()):  # the service's own (malformed.*)
            print(f"  {name} = {value}")
        return 0
    print(f"chunk {format_size(info['chunk_bytes'])}, io engine {info['io_engine']}")
    for tier in info["tiers"]:
        print(f"  {tier['name']:5} {tier['chunks']:>8} chunks  {format_size(tier['used_bytes'])} "
              f"used of {format_size(tier['capacity_bytes'])}")
        for device in tier.get("devices", []):
            why = f" ({device['reason']})" if device["reason"] else ""
            where = "" if device["path"] == device["label"] else f" at {device['path']}"
            print(f"        {device['kind']} {device['label']}{where}: {device['state']}{why}, "
                  f"{device['faults']} faults, {device['trips']} breaker trips")
    cluster = info.get("cluster")
    if cluster:
        error = f", index error: {cluster['index_error']}" if cluster["index_error"] else ""
        if cluster.get("host_id_conflict"):
            error += f", not publishing: {cluster['host_id_conflict']}"
        print(f"  cluster: host {cluster['host_id']}, index {cluster['index_url']}{error}")
        for device in cluster["peer_devices"]:
            why = f" ({device['reason']})" if device["reason"] else ""
            print(f"        peer {device['label']}: {device['state']}{why}")
    _print_admission(info.get("admission", {}), info["counters"])
    recovery = info["recovery"]
    print(f"  recovered {recovery['records']} records ({recovery['torn']} torn) in "
          f"{recovery['seconds'] * 1000:.1f} ms")
    for name, value in sorted(info["counters"].items()):
        print(f"  {name} = {value}")
    return 0


def _print_admission(admission: dict, counters: dict) -> None:
    """Disk admission: its policy, what it admitted and refused, and what is left of its budget."""
    if not admission:
        return
    threshold = f" (return rate at least {admission['threshold']:g})" if "threshold" in admission else ""
    if "loss_budget" in admission:
        threshold += (f", losing {admission['loss_measured']:.2%} of hits lately for a budget of "
                      f"{admission['loss_budget']:.2%}")
    print(f"  disk admission {admission['policy']}{threshold}: {counters.get('disk.admitted', 0):.0f} "
          f"chunks written, {counters.get('disk.admission_refused', 0):.0f} refused")
    if "budget_bytes_per_day" in admission:
        print(f"  write budget {format_size(admission['budget_bytes_per_day'])} a day: "
              f"{format_size(admission['budget_left_bytes'])} left now, return rate at least "
              f"{admission['budget_threshold']:g} admitted, {counters.get('disk.budget_refused', 0):.0f} "
              "refused for it")


def _service_config(args: argparse.Namespace):  # -> StoreConfig
    from kvstore.config.store import load_config, with_service

    config = load_config(args.config)
    return with_service(config, socket=args.socket) if args.socket else config


def _serve(args: argparse.Namespace) -> int:
    from kvstore.service.server import StoreService

    logging.getLogger("kvstore").setLevel(logging.INFO)
    StoreService(_service_config(args)).serve_forever(reload=lambda: _service_config(args),
                                                      hung_up=_HUNG_UP)
    return 0


# SIGHUP's default action ends a process: `kvstore serve` catches it from its first line
# (main) and reloads once serving, so a SIGHUP sent while it starts cannot end it.
_HUNG_UP = SignalFlag()


def _stop(args: argparse.Namespace) -> int:
    from kvstore.service.client import stop_service

    if not stop_service(_service_config(args)):
        print("kvstore: no service is running there", file=sys.stderr)
        return 1
    return 0


# Commands whose module has add_arguments(parser) and run(args) -> exit code. Other
# packages add theirs through the `kvstore.commands` entry-point group: each entry names
# a sequence of such (name, module, help) rows (bench/commands.py registers bench's).
_MODULE_COMMANDS = (
    ("nvmeof", "kvstore.nvmeof_cli", "connect, disconnect and check the NVMe-oF namespaces"),
    ("purge", "kvstore.purge_cli", "remove a model's or a weights generation's records from this host"),
)
_BUILT_IN = {"nvmeof", "purge", "fsck", "info", "serve", "stop"}


def _module_commands(command: str | None) -> list[tuple[str, str, str]]:
    """Built-in module commands, plus registered ones unless `command` is a built-in (so
    `kvstore fsck` never imports another package's registry)."""
    rows = list(_MODULE_COMMANDS)
    if command not in _BUILT_IN:
        for entry in entry_points(group="kvstore.commands"):
            rows += entry.load()
    return rows


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; a module command's module (and what it imports: torch, vLLM,
    matplotlib) is imported only for `command`, the one being run. The others are
    listed by name and help text."""
    parser = argparse.ArgumentParser(prog="kvstore", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    commands = parser.add_subparsers(dest="command", required=True)

    for name, module_name, text in _module_commands(command):
        sub = commands.add_parser(name, help=text)
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
            sub.set_defaults(handler=module.run)

    check = commands.add_parser("fsck", help="verify every record of a disk-tier path")
    check.add_argument("path", help="disk-tier directory, data file or block device")
    check.add_argument("--json", action="store_true")
    check.set_defaults(handler=_fsck)

    info = commands.add_parser("info", help="tiers, capacity, usage and counters of a config")
    info.add_argument("--config", required=True, help="kvstore config (YAML or JSON file)")
    info.add_argument("--chunk-size", help="chunk payload bytes, e.g. 4MiB (only without a "
                      "running service)")
    info.add_argument("--json", action="store_true")
    info.set_defaults(handler=_info)

    for name, handler, text in (("serve", _serve, "run the per-host storage service"),
                                ("stop", _stop, "ask a running service to drain and exit")):
        service = commands.add_parser(name, help=text)
        service.add_argument("--config", required=True, help="kvstore config (YAML or JSON file)")
        service.add_argument("--socket", help="override service.socket")
        service.set_defaults(handler=handler)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    if command == "serve" and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGHUP, _HUNG_UP.raise_)
    args = build_parser(command).parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except KVStoreError as exc:
        print(f"kvstore: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
