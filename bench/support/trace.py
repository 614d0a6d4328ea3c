"""Request traces in the Mooncake format (JSONL), turned into chained chunk keys.

One JSON object a line: `timestamp` (ms), `input_length`, `output_length` (tokens),
`hash_ids` (one id per `block_tokens`-token prefix block; equal ids at equal
positions mean a shared prefix). No token ids are given, so a block's key is
chained over the ids the way kvstore chains token chunks: key_i depends on every
id before it, and two requests share key_i exactly when they share ids [0..i].

`read_passes` gives a trace several times back to back, the earlier passes as other traffic
of the same kind (a policy that learns is then measured as a service that ran before).

`synthetic:<shape>` in place of a path generates a trace of that shape (seeded, so a
run is repeatable; `limit` requests, SYNTHETIC_REQUESTS by default):
  multi-turn  chat sessions (one every 2 s) on one of 40 system prompts of 2-8 blocks
              (Zipf popularity); each turn adds the last answer and a new question
              (1-3 blocks) and is followed by another with probability 0.65 after an
              exponential think time (mean 60 s): a third of sessions are one turn
  agent       tasks (one every 3 s) on one of 8 agent instructions of 6-12 blocks; each
              runs 5-30 steps, each step adding a tool's output (1-2 blocks) after an
              exponential tool latency (mean 3 s): long, deep, quickly returning chains
  returning   chat sessions (one a second) on one of 20 system prompts of 2-6 blocks
              (Zipf) that come back after minutes, past DRAM's residence time. 70% are
              one-off questions (answers of about 60 tokens, lognormal; a follow-up with
              probability 0.1); 30% are working sessions (after each turn the user goes on
              with probability 0.85, to answers of about 500 tokens; the last turn is a
              brief exchange, an answer of about 20). A user who goes on comes back within
              seconds (exponential, mean 30 s) or, half the time, after 5-15 minutes
              (uniform); each turn adds the answer's full blocks and a new message (1-3
              blocks). How a request ends (its answer's length) says whether it returns,
              as the answer length did on the Mooncake trace
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvstore.format.errors import KVStoreError

MOONCAKE_BLOCK_TOKENS = 512
SYNTHETIC_REQUESTS = 4000
SHAPES = ("multi-turn", "agent", "returning")


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    keys: tuple[bytes, ...]  # one per *full* block of the prompt


def block_keys(hash_ids: list[int]) -> tuple[bytes, ...]:
    keys, previous = [], bytes(16)
    for block_id in hash_ids:
        previous = xxhash.xxh3_128_digest(previous + int(block_id).to_bytes(8, "little", signed=True))
        keys.append(previous)
    return tuple(keys)


def read_trace(path: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
               limit: int | None = None, seed: int = 0) -> Iterator[TraceRequest]:
    """Requests in file order; a partial last block gets no key (it is never stored).
    `seed`: a synthetic shape's."""
    if str(path).startswith("synthetic:"):
        shape = str(path).partition(":")[2]
        if shape not in SHAPES:
            raise KVStoreError(f"{path}: no such synthetic trace; shapes: {', '.join(SHAPES)}")
        for row in synthetic_rows(shape, limit or SYNTHETIC_REQUESTS, block_tokens, seed):
            yield _request(row, block_tokens)
        return
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if limit is not None and number > limit:
                return
            if not line.strip():
                continue
            try:
                request = _request(json.loads(line), block_tokens)
            except (ValueError, KeyError, TypeError) as exc:
                raise KVStoreError(f"{path}:{number}: not a Mooncake trace line ({exc})") from exc
            yield request


def read_passes(path: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS, limit: int | None = None,
                passes: int = 1) -> list[list[TraceRequest]]:
    """The trace `passes` times back to back, a minute apart, the last being the trace itself
    (shifted in time): each earlier pass is other traffic of the same kind, a synthetic
    shape's next seed or a file's requests again, its blocks renamed so that it shares none
    with the others."""
    if passes < 1:
        raise KVStoreError(f"{passes} passes: at least 1")
    last = list(read_trace(path, block_tokens, limit))
    earlier = []
    for number in range(1, passes):
        requests = list(read_trace(path, block_tokens, limit, seed=number))
        earlier.append([dataclasses.replace(r, keys=tuple(xxhash.xxh3_128_digest(b"%d" % number + key)
                                                         for key in r.keys)) for r in requests])
    runs, start = [], 0.0
    for requests in [*earlier, last]:
        runs.append([dataclasses.replace(r, arrival_s=r.arrival_s + start) for r in requests])
        start += max((r.arrival_s for r in requests), default=0.0) + 60.0
    return runs


def _request(row: dict, block_tokens: int) -> TraceRequest:
    input_tokens = int(row["input_length"])
    hash_ids = list(row["hash_ids"])
    return TraceRequest(arrival_s=float(row["timestamp"]) / 1000.0, input_tokens=input_tokens,
                        output_tokens=int(row.get("output_length", 0)),
                        keys=block_keys(hash_ids[: input_tokens // block_tokens]))


def synthetic_rows(shape: str, requests: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                   seed: int = 0) -> list[dict]:
    """`requests` Mooncake-format rows of a shape (module docstring), by arrival."""
    rng = random.Random(seed)
    if shape == "returning":
        return _returning_rows(requests, block_tokens, rng)
    fresh = itertools.count(1)
    chat = shape == "multi-turn"
    prompts = [[next(fresh) for _ in range(rng.randint(2, 8) if chat else rng.randint(6, 12))]
               for _ in range(40 if chat else 8)]
    weights = [1 / (rank + 1) ** 1.1 for rank in range(len(prompts))]
    # (arrival, order, context ids, turns left): a session's next request
    due: list[tuple[float, int, list[int], int]] = []
    order = itertools.count()
    start = 0.0
    rows: list[dict] = []
    while len(rows) < requests:
        start += rng.expovariate(1 / (2.0 if chat else 3.0))
        context = list(rng.choices(prompts, weights)[0])
        turns = 1_000_000 if chat else rng.randint(5, 30)
        heapq.heappush(due, (start, next(order), context, turns))
        while due and due[0][0] <= start and len(rows) < requests:
            at, _, context, turns = heapq.heappop(due)
            context = context + [next(fresh) for _ in range(rng.randint(1, 3) if chat else rng.randint(1, 2))]
            rows.append({"timestamp": int(at * 1000), "input_length": len(context) * block_tokens,
                         "output_length": rng.randint(50, 400), "hash_ids": context})
            more = rng.random() < 0.65 if chat else turns > 1
            if more:
                gap = rng.expovariate(1 / 60.0) if chat else rng.expovariate(1 / 3.0)
                heapq.heappush(due, (at + gap, next(order), context, turns - 1))
    return rows


def _returning_rows(requests: int, block_tokens: int, rng: random.Random) -> list[dict]:
    """The `returning` shape (module docstring): sessions whose users come back after minutes."""
    fresh = itertools.count(1)
    prompts = [[next(fresh) for _ in range(rng.randint(2, 6))] for _ in range(20)]
    weights = [1 / (rank + 1) ** 1.1 for rank in range(len(prompts))]
    due: list[tuple[float, int, list[int], bool]] = []  # (arrival, order, context ids, working)
    order = itertools.count()
    start = 0.0
    rows: list[dict] = []
    while len(rows) < requests:
        start += rng.expovariate(1.0)
        heapq.heappush(due, (start, next(order), list(rng.choices(prompts, weights)[0]), rng.random() < 0.3))
        while due and due[0][0] <= start and len(rows) < requests:
            at, _, context, working = heapq.heappop(due)
            context = context + [next(fresh) for _ in range(rng.randint(1, 3))]
            goes_on = rng.random() < (0.85 if working else 0.1)
            median = (500 if goes_on else 20) if working else 60  # a working session ends on a brief reply
            answer = max(1, int(rng.lognormvariate(math.log(median), 0.5)))
            rows.append({"timestamp": int(at * 1000), "input_length": len(context) * block_tokens,
                         "output_length": answer, "hash_ids": context})
            if goes_on:
                gap = rng.expovariate(1 / 30.0) if rng.random() < 0.5 else rng.uniform(300.0, 900.0)
                context = context + [next(fresh) for _ in range(answer // block_tokens)]
                heapq.heappush(due, (at + gap, next(order), context, working))
    return rows
