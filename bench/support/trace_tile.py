"""A bigger Mooncake-format trace from a small one: its requests as K tenants' traffic.

    python -m bench.support.trace_tile IN.jsonl OUT.jsonl --copies 4

Each copy keeps every request (arrival, lengths, the shape of its prefix sharing) with
its block ids renamed, so copies share no block: K tenants with the same traffic, K
times the distinct blocks and the rate, merged by arrival time. The synthetic Mooncake
trace has 43,924 distinct blocks; 4 copies have 175,696, the working set of the 16-host
replay in docs/cluster.md.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
from pathlib import Path
from typing import Any


def tile(source: str | Path, copies: int) -> list[dict[str, Any]]:
    """The `copies` renamed copies of `source`'s requests, in arrival order (stable)."""
    if copies < 1:
        raise ValueError(f"--copies {copies}: must be at least 1")
    rows = [json.loads(line) for line in Path(source).read_text().splitlines() if line.strip()]
    for i, (row, after) in enumerate(itertools.pairwise(rows)):
        if after["timestamp"] < row["timestamp"]:  # the merge below needs each copy in order
            raise ValueError(f"{source}: request {i + 2} arrives at {after['timestamp']}, before request "
                             f"{i + 1} ({row['timestamp']}): the trace must be in arrival order")
    stride = 1 + max((i for row in rows for i in row["hash_ids"]), default=0)
    tenants = [[{**row, "hash_ids": [i + k * stride for i in row["hash_ids"]]} for row in rows]
               for k in range(copies)]
    return list(heapq.merge(*tenants, key=lambda row: row["timestamp"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--copies", type=int, default=4)
    args = parser.parse_args(argv)
    try:
        rows = tile(args.source, args.copies)
    except ValueError as exc:
        parser.error(str(exc))
    Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))
    blocks = len({i for row in rows for i in row["hash_ids"]})
    print(f"{len(rows)} requests, {blocks} distinct blocks -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
