"""The runner of the experiments, `python -m bench.lab NAME [args]` (bench/lab/__init__.py
says what an experiment module gives): one parser with the common flags, one work
directory, the table printed and --json written the same way for every experiment.
`python -m bench.lab --help` lists them."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

from bench.lab import EXPERIMENTS, Result, Unavailable
from bench.support.runs import run_workdir


def build_parser(name: str | None) -> tuple[argparse.ArgumentParser, ModuleType | None]:
    """The runner's parser; only `name`'s module is imported and given its flags."""
    parser = argparse.ArgumentParser(prog="python -m bench.lab",
                                     description="kvstore's experiments, each run as `python -m bench.lab "
                                                 "NAME [its flags] [--workdir DIR] [--json PATH]`",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    experiments = parser.add_subparsers(dest="experiment", required=True, metavar="NAME",
                                        title="experiments")
    chosen = None
    for experiment, text in EXPERIMENTS:
        if experiment != name:
            experiments.add_parser(experiment, help=text)
            continue
        chosen = importlib.import_module(f"bench.lab.{experiment}")
        sub = experiments.add_parser(experiment, help=text, description=chosen.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
        chosen.add_arguments(sub)
        sub.add_argument("--workdir", help="keep what the run writes here (default: a temporary "
                                           "directory, removed at the end)")
        default = getattr(chosen, "JSON_DEFAULT", None)
        sub.add_argument("--json", default=default, help="also write the results here as JSON"
                         + (f" (default: {default})" if default else ""))
    return parser, chosen


def run(name: str, argv: list[str] | None = None) -> Result:
    """Run experiment `name` with its flags `argv` as the command line would, and return
    its Result (after printing the table and writing --json)."""
    parser, module = build_parser(name)
    args = parser.parse_args([name, *(argv or [])])
    assert module is not None
    parent = getattr(module, "WORKDIR_PARENT", None)
    with run_workdir(args.workdir, f"kvstore-{name}-", parent) as workdir:
        result: Result = module.experiment(args, workdir)
    print(result.table, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result.document, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    name = next((arg for arg in argv if not arg.startswith("-")), None)
    if name not in dict(EXPERIMENTS):
        build_parser(None)[0].parse_args(argv)  # --help, or the error naming the choices
        return 2
    rest = list(argv)
    rest.remove(name)
    try:
        return 0 if run(name, rest).ok else 1
    except Unavailable as exc:
        print(f"python -m bench.lab {name}: {exc}", file=sys.stderr)
        return 2
