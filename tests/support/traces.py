"""Block traces for the replay tests (one JSON line a request, as bench/support/trace.py reads)."""

from __future__ import annotations

import json

BLOCK = 4  # tokens per block; with 1 byte per token a chunk is 4 bytes


def write_trace(path, rows) -> str:
    """A trace at `path` of one request a row, (hash ids, input length), 1 ms apart."""
    with open(path, "w") as f:
        for i, (ids, length) in enumerate(rows):
            f.write(json.dumps({"timestamp": i * 1000, "input_length": length, "output_length": 1,
                                "hash_ids": ids}) + "\n")
    return str(path)
