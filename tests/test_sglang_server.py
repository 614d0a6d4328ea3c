"""SGLang's own HTTP server, end to end, with kvstore as HiCache's storage backend.

SGLang 0.5.23's server (.venv-sglang: scripts/setup_sglang.sh) serves the real chat model
(SmolLM2-135M-Instruct, bench/support/chat_model.py) on the CPU through bench/support/sglang_cpu.py's
stand-ins, and loads kvstore's backend with its `dynamic` factory, unchanged
(bench/support/sglang_server.py starts it). For each host-pool layout, `layer_first` and
`page_first` (which SGLang's `direct` io backend keeps as `page_first_direct`), one
kvstore service and two servers, A and B, both kept up for the module:

- A answers three 356-token prompts (22 full pages each) from scratch and stores them
  through kvstore: its greedy tokens and top-5 logprobs are the reference;
- B, a new process started beside A, answers P1: SGLang reports the 352 tokens of the
  full pages as loaded from `storage` (meta_info.cached_tokens_details), kvstore counts
  22 DRAM hits, and the tokens agree with A's (vLLM's check_logprobs_close convention:
  bench/support/answers.py);
- `kvstore stop`, and one payload byte of P3's first page flipped on disk; B answers P2:
  the service respawns, recovers its records and serves all 22 pages from disk; then P3:
  that page fails its checksum, a counted miss, and B recomputes the prompt (the pages
  after the first are not loaded: SGLang loads a leading run only) with A's answer;
- (layer_first only: the layout changes nothing there) a conversation over
  /v1/chat/completions, turn by turn on A, B, A: each turn finds the previous turn's
  prompt and answer, computed by the other server, in storage.

Every check of what was loaded asks for SGLang's storage count and kvstore's own hit
counters, so a backend removed or loading nothing fails them. Both servers stay up
through all the checks of a layout, so a run starts four servers in all.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support.records import corrupt_record, disk_records
from support.services import stop_service
from support.stores import direct_io_dir

from bench.support.answers import compare
from bench.support.chat_model import WheelUnavailable, build_chat_model, default_chat_model_dir
from bench.support.conversation import QUESTIONS, reuse_bound
from bench.support.runs import wait_held
from bench.support.sglang_server import (
    PAGE_TOKENS,
    SHM,
    VOCAB,
    Generation,
    SGLangServer,
    kvstore_backend,
    kvstore_store,
    reconnect,
    remove_shm_leftovers,
    sglang_python,
    shm_leftovers,
)
from bench.support.tiny_model import prompt_token_ids
from kvstore.config.store import load_config
from kvstore.service.client import service_info

pytestmark = [pytest.mark.slow, pytest.mark.sglang, pytest.mark.timeout(1500)]

PROMPT_TOKENS = 356
PAGES = PROMPT_TOKENS // PAGE_TOKENS  # 22 full pages: 352 tokens
NEW_TOKENS = 8
PROMPTS = {name: prompt_token_ids(PROMPT_TOKENS, seed=seed, vocab=VOCAB)
           for name, seed in (("P3", 3), ("P1", 1), ("P2", 2))}  # P3 first: its records come first on disk
SYSTEM = "You are a helpful assistant for a city guide. Answer in full sentences."


@dataclass
class Pair:
    """One layout's kvstore service and servers A and B, with what each has answered."""

    layout: str
    store: dict[str, Any]
    a: SGLangServer
    b: SGLangServer
    reference: dict[str, Generation]  # A's answers, computed
    answers: dict[str, Generation] = field(default_factory=dict)  # B's
    hits: dict[str, dict[str, int]] = field(default_factory=dict)  # kvstore's counters each B answer moved


@pytest.fixture(scope="module")
def python() -> Path:
    found = sglang_python()
    if found is None:
        pytest.skip(".venv-sglang is not built: scripts/setup.sh builds it with scripts/setup_sglang.sh "
                    "and says why where it could not")
    return found


@pytest.fixture(scope="module")
def model() -> Path:
    pytest.importorskip("gguf", reason="needs gguf (the vllm extra) to build the chat model")
    try:
        return build_chat_model(default_chat_model_dir())
    except WheelUnavailable as exc:
        pytest.skip(str(exc))


def service_counters(store: dict[str, Any]) -> dict[str, int]:
    info = service_info(load_config(store)) or {}
    return dict(info.get("counters") or {})


def moved(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counters that changed, by how much."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def settle(store: dict[str, Any], timeout_s: float = 60) -> None:
    """Until the pages kvstore holds stop growing (for a second)."""
    deadline, held = time.monotonic() + timeout_s, -1
    while time.monotonic() < deadline:
        now = sum(int(t["chunks"]) for t in (service_info(load_config(store)) or {}).get("tiers", ()))
        if now == held:
            return
        held = now
        time.sleep(1)


def ask(pair: Pair, name: str, prompt: list[int]) -> None:
    """B answers `prompt`; its answer and the counters it moved are kept under `name`."""
    before = service_counters(pair.store)  # none: a stopped service, respawned by this request
    pair.answers[name] = pair.b.generate(prompt, NEW_TOKENS)
    pair.hits[name] = moved(before, service_counters(pair.store))


@pytest.fixture(scope="module", params=["layer_first", "page_first"])
def pair(request, python, model, tmp_path_factory) -> Iterator[Pair]:
    """The service, A storing the prompts, then B beside it answering P1 from DRAM."""
    layout = request.param
    work = Path(direct_io_dir(tmp_path_factory.mktemp(f"sglang-{layout}")))
    store, config = kvstore_store(work)
    backend = kvstore_backend(config, prefetch_threshold=PAGE_TOKENS)
    with ExitStack() as stack:
        stack.callback(stop_service, store)
        a = stack.enter_context(SGLangServer(python, model, backend, work / "a.log", layout=layout))
        reference = {name: a.generate(prompt, NEW_TOKENS) for name, prompt in PROMPTS.items()}
        held = wait_held(store, len(PROMPTS) * PAGES)
        assert held >= len(PROMPTS) * PAGES, f"kvstore holds {held} pages"
        b = stack.enter_context(SGLangServer(python, model, backend, work / "b.log", layout=layout))
        found = Pair(layout, store, a, b, reference)
        ask(found, "dram", PROMPTS["P1"])
        yield found


@pytest.fixture(scope="module")
def restarted(pair) -> Pair:
    """`kvstore stop`, P3's first page flipped on disk, then B answers P2 and P3."""
    stop_service(pair.store)
    disk = pair.store["tiers"]["disk"][0]["path"]
    records = disk_records(disk)
    first = min(r.seq for r in records)
    chain = [r for r in records if r.seq == first]  # A's first put: P3's pages, in order
    corrupt_record(disk, key=next(r.key for r in chain if r.parent not in {c.key for c in chain}))
    reconnect(pair.a, pair.b)
    ask(pair, "disk", PROMPTS["P2"])
    ask(pair, "flipped", PROMPTS["P3"])
    return pair


def same_answer(pair: Pair, name: str, prompt: str) -> None:
    a, b = pair.reference[prompt], pair.answers[name]
    assert len(a.output_ids) == NEW_TOKENS
    found = compare(a, b, ("A", "B"))
    assert found.close, f"{pair.layout}: B's answer to {prompt} is not A's: {found.describe()}"


def test_a_new_server_loads_the_prompt_from_kvstores_dram(pair):
    assert all(r.storage == 0 for r in pair.reference.values()), "A found pages before any were stored"
    assert pair.answers["dram"].details.get("storage") == PAGES * PAGE_TOKENS, pair.answers["dram"].details
    assert pair.answers["dram"].details.get("device") == 0
    assert pair.hits["dram"].get("dram.hits") == PAGES, pair.hits["dram"]
    assert not pair.hits["dram"].get("disk.hits"), pair.hits["dram"]
    same_answer(pair, "dram", "P1")


def test_after_kvstore_stop_it_loads_the_prompt_from_disk(restarted):
    assert restarted.answers["disk"].storage == PAGES * PAGE_TOKENS, restarted.answers["disk"].details
    assert restarted.hits["disk"].get("disk.hits") == PAGES, restarted.hits["disk"]
    same_answer(restarted, "disk", "P2")


def test_a_flipped_byte_on_disk_is_a_miss_and_the_prompt_is_recomputed(restarted):
    assert restarted.answers["flipped"].storage == 0, restarted.answers["flipped"].details
    assert restarted.hits["flipped"].get("disk.miss.bad_checksum", 0) >= 1, restarted.hits["flipped"]
    same_answer(restarted, "flipped", "P3")


@pytest.mark.parametrize("pair", ["layer_first"], indirect=True)  # the layout changes nothing here
def test_each_chat_turn_finds_the_previous_answer_from_the_other_server(pair):
    """A and B at once on one service: turns 1 and 3 on A, turn 2 on B. Each turn's
    prompt is the previous one's, its answer and a new question: the previous answer was
    computed by the other server, so only kvstore can have served it."""
    messages = [{"role": "system", "content": SYSTEM}]
    turns = []
    for server, question in zip((pair.a, pair.b, pair.a), QUESTIONS, strict=False):
        messages.append({"role": "user", "content": question})
        turns.append(server.chat(messages, max_tokens=32))
        messages.append({"role": "assistant", "content": turns[-1].text})
        settle(pair.store)  # the user's think time: the server stores the turn behind its answer
    assert turns[0].storage == 0
    for number, (previous, turn) in enumerate(itertools.pairwise(turns), start=2):
        common, bound = reuse_bound(previous, turn, PAGE_TOKENS)
        answered = (len(previous.prompt_token_ids) // PAGE_TOKENS) * PAGE_TOKENS
        assert bound > answered, f"turn {number} shares too little with turn {number - 1} to tell: {common}"
        assert turn.storage > 0, f"turn {number}: nothing from storage: {turn.details}"
        assert turn.cached_tokens >= bound - PAGE_TOKENS, (
            f"turn {number}: {turn.cached_tokens} cached ({turn.details}) of a {bound}-token bound")


def test_the_leftover_sweep_spares_every_live_processs_semaphores():
    """The sweep after a server stops removes what no live process holds, never a semaphore
    another program's multiprocessing made meanwhile: that one is mapped under the
    temporary name it was made with, and removing it fails the program's next spawn (it
    failed a vLLM engine's start on the other test worker)."""
    before = shm_leftovers()
    lock = multiprocessing.get_context("spawn").Lock()  # live: this process maps it
    orphan = SHM / f"sem.mp-kvstore-test-{os.getpid()}"  # made, and nobody holds it
    orphan.write_bytes(bytes(32))
    try:
        live = shm_leftovers() - before - {orphan.name}
        assert live, "the lock made no semaphore in /dev/shm"
        remove_shm_leftovers(before)
        assert live <= shm_leftovers(), "a live semaphore was removed"
        assert not orphan.exists()
    finally:
        orphan.unlink(missing_ok=True)
        del lock
