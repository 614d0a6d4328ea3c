"""`kvstore purge`: remove one model's (or one weights generation's) records from every
tier of this host, for space or because a user asked to be forgotten; the service's
owner only. Namespaces are named by what engines announced (`--list`, asked of the service
a page at a time): model, weights fingerprint, generation; or by digest (`--namespace`).
`--dry-run` says what would go.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from kvstore.format.units import format_size

if TYPE_CHECKING:
    from kvstore.service.client import StoreClient


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="kvstore config (YAML or JSON file)")
    parser.add_argument("--list", action="store_true", help="show the announced namespaces, by model, "
                        "weights and generation, and remove nothing")
    parser.add_argument("--model", help="the model (as engines name it: model_id or the model path)")
    parser.add_argument("--weights", help="its weights fingerprint or revision (or a prefix of it)")
    parser.add_argument("--generation", help="one generation of those weights ('base': the one an "
                        "engine starts with; default: every generation)")
    parser.add_argument("--namespace", action="append", default=[], metavar="HEX",
                        help="a namespace digest (32 hex digits), named directly; may be repeated")
    parser.add_argument("--dry-run", action="store_true", help="count what would be removed, remove nothing")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from kvstore.config.store import load_config
    from kvstore.service.client import ServiceUnavailable, attach

    config = load_config(args.config)
    try:
        client = attach(config)
    except ServiceUnavailable:
        print(f"kvstore: no service at {config.service.socket}: purge asks the running service",
              file=sys.stderr)
        return 2
    try:
        entries = _announced(client)
        if args.list:
            return _list(entries, args.json)
        if not (args.model or args.namespace):
            print("kvstore: purge needs --model (with --weights, --generation) or --namespace",
                  file=sys.stderr)
            return 2
        try:
            named = [bytes.fromhex(digest) for digest in args.namespace]
        except ValueError:
            named = []
        if len(named) != len(args.namespace) or any(len(digest) != 16 for digest in named):
            print("kvstore: --namespace takes a namespace digest: 32 hex digits", file=sys.stderr)
            return 2
        chosen = named + [bytes.fromhex(entry["namespace"]) for entry in entries
                          if _matches(entry["description"], args)]
        if not chosen:
            print("kvstore: no announced namespace matches (see kvstore purge --list)", file=sys.stderr)
            return 1
        report = client.purge(chosen, dry_run=args.dry_run)
    finally:
        client.close()
    if args.json:
        print(json.dumps({"namespaces": len(chosen), "dry_run": args.dry_run, **report}))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    count = report["chunks"] if args.dry_run else report["removed"]
    print(f"{verb} {count} chunks ({format_size(report['bytes'])}: {report['dram_chunks']} in DRAM, "
          f"{report['disk_chunks']} on disk) of {len(chosen)} namespaces"
          + (f"; {report['unread']} disk headers could not be read" if report["unread"] else ""))
    if report.get("pending") and not args.dry_run:
        print(f"{report['pending']} namespaces stay pending (no engine has opened the store since the "
              "service started, or a disk device is out of service): purged when it is back, "
              "across restarts")
    return 0


def _announced(client: StoreClient) -> list[dict[str, Any]]:
    """Every namespace the service's book holds, a page at a time (a reply of the whole
    book would not fit a frame), each page after the last one's last digest."""
    found: list[dict[str, Any]] = []
    page = client.namespaces()
    while page:
        found += page
        page = client.namespaces(bytes.fromhex(page[-1]["namespace"]))
    return found


def _matches(description: dict[str, Any], args: argparse.Namespace) -> bool:
    if args.model is None or description.get("model") != args.model:
        return False
    if args.weights and not str(description.get("weights", "")).startswith(args.weights):
        return False
    generation = str(description.get("generation", "")) or "base"
    return args.generation is None or generation == args.generation


def _list(entries: list[dict[str, Any]], as_json: bool) -> int:
    if as_json:
        print(json.dumps(entries, indent=2))
        return 0
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for entry in entries:
        described = entry["description"]
        groups[(str(described.get("model", "?")), str(described.get("weights", "")),
                str(described.get("generation", "")) or "base")].append(entry)
    if not groups:
        print("no namespace announced yet")
    for (model, weights, generation), members in sorted(groups.items()):
        last = datetime.datetime.fromtimestamp(max(e["last"] for e in members)).isoformat(timespec="seconds")
        uids = ",".join(str(u) for u in sorted({e["uid"] for e in members}))
        print(f"{model}  weights {weights or '-'}  generation {generation}: {len(members)} namespaces "
              f"(uid {uids}; last announced {last})")
    return 0
