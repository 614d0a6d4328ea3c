"""`kvstore verify`: the cases where KV stores have served wrong KV, sent to a vLLM OpenAI
server with kvstore and judged against a server without it.

    kvstore verify [--workdir DIR] [--json out.json]
    kvstore verify --url URL --reference-url URL --model NAME [--config kvstore.yaml]

Without --url it starts both servers itself on a tiny random-weight LLaVA with a LoRA
adapter (bench/support/tiny_vlm.py; vLLM's prefix cache off on both, so every cached token is
kvstore's). With --url it speaks to running servers: the kvstore one (prefix caching
off) and a reference without a connector, serving the same model under the same name;
--config names the kvstore server's config, which the half-way-store case needs (it
kills that service). Each case sends a request that stores, then the request a wrong
store would answer from those chunks, and judges the second as vLLM's tests judge
answers (bench/support/answers.py) against the reference, and its cached tokens against what it
may share with the first:

  images          the same text with another image: only the chunks before the image
  image offsets   two images in swapped places: only the chunks before the first image
  lora            the base model, then a LoRA adapter: nothing
  cache salt      two salts: nothing; the first salt again: everything
  long prompt     more than 128 chunks (160 x 256 tokens by default; LMCache's issue 5151
                  served other context between chunks 114 and 128), then a prompt sharing
                  its first 120 chunks: those 120
  killed write    the service killed while it writes a prompt to disk, restarted: what it
                  serves of that prompt is whole (never a torn record)
  disk full       a write that fails is never a hit (reported `not available`: a live
                  server's disk tier cannot fill mid-write; see the case)
  weights         the same path with other weights (its own servers only: the model is
                  rewritten and both restarted): nothing (the namespace's weight fingerprint)

A case is `pass`, `FAIL` (the exit status is 1), or `not available` with the reason (the
model takes no images, the server serves no LoRA, no --config, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.support.answers import Answer, compare
from bench.support.openai_server import ChatReply, Completion, OpenAIServer, chat, complete, completion_body
from bench.support.runs import run_workdir
from bench.support.tiny_model import prompt_token_ids, prompt_words
from bench.support.tiny_vlm import build_tiny_llava, build_tiny_lora, image_message, image_url, server_env
from kvstore.config.store import StoreConfig, load_config
from kvstore.service.client import service_info, stop_service

CHUNK = 256
VOCAB = 500  # token ids below this are valid for any model with a vocabulary of 500 or more
MAX_TOKENS = 8
LORA = "tiny-lora"
SERVER_ARGS = ["--dtype", "float16", "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
               "--enforce-eager", "--served-model-name", "vlm", "--chat-template-content-format", "openai",
               "--limit-mm-per-prompt", '{"image": 2}']


@dataclass
class Result:
    case: str
    outcome: str  # pass, FAIL, not available
    detail: str


class NotAvailable(Exception):
    """The case cannot run against these servers; the message says why."""


@dataclass
class Target:
    """The two servers a run speaks to, and what it knows of the kvstore one."""

    url: str
    reference_url: str
    model: str
    store: StoreConfig | None  # the kvstore server's config (None: not given)
    chunk_tokens: int
    long_chunks: int
    lora_problem: str | None = None  # why the servers serve no LoRA adapter, where known
    swap_weights: Callable[[], None] | None = None  # own servers: other weights at the same path, restarted


def check(second: ChatReply | Completion, expected: Answer, shareable: int,
          must_load: int | None = None) -> str:
    """Raises AssertionError with the reason unless `second` answers as `expected` by vLLM's
    bar and loaded at most `shareable` tokens (exactly `must_load` if given). Returns what
    was seen."""
    found = compare(expected, second, ("reference", "kvstore"))
    cached = second.cached_tokens
    seen = f"loaded {cached} tokens (may share {shareable}); answer {found.verdict}"
    if not found.close:
        raise AssertionError(f"{seen}: {found.describe()}")
    if cached > shareable:
        raise AssertionError(f"{seen}: served chunks the first request stored for other input")
    if must_load is not None and cached != must_load:
        raise AssertionError(f"{seen}: expected {must_load}")
    return seen


def _ask(url: str, model: str, messages: list[dict[str, Any]],
         extra: dict[str, Any] | None = None) -> ChatReply:
    return chat(url, model, messages, MAX_TOKENS, extra=extra)


def _complete(url: str, model: str, prompt: list[int], extra: dict[str, Any] | None = None) -> Completion:
    return complete(url, {**completion_body(model, prompt, MAX_TOKENS), **(extra or {})}, timeout_s=1200)


def _floor(tokens: int, chunk: int) -> int:
    return tokens // chunk * chunk


def _image_case(target: Target, texts: list[str], orders: list[list[int]]) -> str:
    """Two prompts of the same `texts` with images between them: those of `orders[0]`
    (image seeds), then those of `orders[1]`."""

    def messages(seeds: list[int]) -> list[dict[str, Any]]:
        parts = [texts[0]]
        for seed, text in zip(seeds, texts[1:], strict=True):
            parts += [image_url(seed), text]
        return image_message(*parts)

    try:
        references = [_ask(target.reference_url, target.model, messages(o)) for o in orders]
    except RuntimeError as exc:
        raise NotAvailable(f"the reference takes no images ({str(exc)[:120]})") from None
    apart = compare(references[0], references[1], ("first", "second"))
    if apart.close:
        raise NotAvailable(f"the model does not tell these images apart ({apart.describe()})")
    _ask(target.url, target.model, messages(orders[0]))  # stored
    second = _ask(target.url, target.model, messages(orders[1]))
    return check(second, references[1], _floor(_first_image(references), target.chunk_tokens))


def _first_image(references: list[ChatReply]) -> int:
    """Where the two prompts' tokens stop agreeing, or, where the tokens agree (image
    placeholders are the same token whatever the image), the first placeholder run: the
    longest run of one repeated token."""
    a, b = references[0].prompt_token_ids, references[1].prompt_token_ids
    if a != b:
        return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    best, start, run = 0, 0, 1
    for i in range(1, len(a) + 1):
        if i < len(a) and a[i] == a[i - 1]:
            run += 1
            continue
        if run > best:
            best, start = run, i - run
        run = 1
    return start


def case_images(target: Target) -> str:
    """The image in the second of three full chunks (with the tiny LLaVA)."""
    return _image_case(target, [prompt_words(230, seed=41), prompt_words(420, seed=43)], [[1], [2]])


def case_image_offsets(target: Target) -> str:
    """The first image in the first chunk, the second in the third, the prompt ending on
    it (a random model's answer follows its last input, so the two orders answer
    differently): a key of the images in a prompt without their places would load two
    chunks of the other order's KV."""
    texts = [prompt_words(150, seed=44), prompt_words(250, seed=45), ""]
    return _image_case(target, texts, [[1, 2], [2, 1]])


def case_lora(target: Target) -> str:
    loras = _loras(target.url) & _loras(target.reference_url)
    if not loras:
        raise NotAvailable(target.lora_problem or "the servers serve no common LoRA adapter (start both "
                           "with --enable-lora --lora-modules NAME=PATH)")
    lora = sorted(loras)[0]
    prompt = prompt_token_ids(4 * target.chunk_tokens + 1, seed=51, vocab=VOCAB)
    expected = _complete(target.reference_url, lora, prompt)
    base = _complete(target.reference_url, target.model, prompt)
    if compare(base, expected).close:
        raise NotAvailable(f"the adapter {lora} answers as the base model does")
    _complete(target.url, target.model, prompt)  # stored
    return f"adapter {lora}: " + check(_complete(target.url, lora, prompt), expected, 0)


def _loras(url: str) -> set[str]:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as reply:
        models = json.load(reply)["data"]
    return {m["id"] for m in models if m.get("parent")}


def case_cache_salt(target: Target) -> str:
    prompt = prompt_token_ids(4 * target.chunk_tokens + 1, seed=61, vocab=VOCAB)
    expected = _complete(target.reference_url, target.model, prompt)
    _complete(target.url, target.model, prompt, {"cache_salt": "salt-one"})  # stored
    other = check(_complete(target.url, target.model, prompt, {"cache_salt": "salt-two"}), expected, 0)
    full = _floor(len(prompt) - 1, target.chunk_tokens)
    again = check(_complete(target.url, target.model, prompt, {"cache_salt": "salt-one"}), expected, full,
                  must_load=full)
    return f"other salt: {other}; same salt again: {again}"


def case_long_prompt(target: Target) -> str:
    chunk, total, shared = target.chunk_tokens, target.long_chunks, min(120, target.long_chunks - 8)
    prompt = prompt_token_ids(total * chunk + 1, seed=71, vocab=VOCAB)
    branch = prompt[: shared * chunk] + prompt_token_ids((total - shared) * chunk + 1, seed=72, vocab=VOCAB)
    expected = {name: _complete(target.reference_url, target.model, p)
                for name, p in (("prompt", prompt), ("branch", branch))}
    _complete(target.url, target.model, prompt)  # stored
    side = check(_complete(target.url, target.model, branch), expected["branch"], shared * chunk,
                 must_load=shared * chunk)
    full = total * chunk
    again = check(_complete(target.url, target.model, prompt), expected["prompt"], full, must_load=full)
    return f"{total} chunks of {chunk}; a prompt sharing {shared}: {side}; the prompt again: {again}"


def case_killed_write(target: Target) -> str:
    """A 96-chunk prompt is stored a step at a time; the service is killed (SIGKILL) once
    its disk writes for it reach a third of the prompt (`write_policy: write_through`
    writes each chunk as it is stored; with `write_back` chunks reach disk at eviction or
    shutdown, so the kill comes when the request ends). The engine starts a new service,
    which recovers the disk tier; the prompt again may load only whole records, and must
    answer as the reference."""
    store = target.store
    if store is None:
        raise NotAvailable("needs --config (the kvstore server's config: its service is killed)")
    if not store.tiers.disk:
        raise NotAvailable("the kvstore server's config has no disk tier")
    chunk = target.chunk_tokens
    prompt = prompt_token_ids(96 * chunk + 1, seed=81, vocab=VOCAB)
    expected = _complete(target.reference_url, target.model, prompt)
    info = service_info(store)
    if info is None:
        raise AssertionError("no kvstore service answers at the config's socket")
    third = int(info.get("counters", {}).get("disk.bytes_written", 0)) + 32 * int(info["chunk_bytes"])
    done: list[Completion] = []
    sender = threading.Thread(target=lambda: done.append(_complete(target.url, target.model, prompt)))
    sender.start()
    writing = False
    while sender.is_alive() and not writing:
        now = service_info(store) or {}
        writing = int(now.get("counters", {}).get("disk.bytes_written", 0)) >= third
        time.sleep(0.01)
    os.kill(int(info["service_pid"]), signal.SIGKILL)
    when = ("with a third of the prompt written to disk" if writing
            else "after the request, before a third of it was on disk")
    sender.join()
    assert done, "the request that was storing when the service died failed"
    # The engine's links reconnect (and start a new service) at most every 5 s.
    deadline = time.monotonic() + 60
    while service_info(store) is None and time.monotonic() < deadline:
        time.sleep(6)
        _complete(target.url, target.model, prompt_token_ids(chunk + 1, seed=82, vocab=VOCAB))
    restarted = service_info(store) or {}
    on_disk = sum(t["chunks"] for t in restarted.get("tiers", []) if t.get("name") != "dram")
    seen = check(_complete(target.url, target.model, prompt), expected, _floor(len(prompt) - 1, chunk))
    return f"service killed {when}; {on_disk} whole chunks on disk after its restart; again: {seen}"


def case_disk_full(target: Target) -> str:
    raise NotAvailable("not against a live server: a disk tier reserves its whole capacity when the "
                       "service starts (posix_fallocate), so a full filesystem fails that start, not a "
                       "write; a write that fails (ENOSPC, EIO) is never published: "
                       "tests/test_faults.py::test_failed_disk_write_is_not_published")


def case_weights(target: Target) -> str:
    """A prompt stored (and hit once), then the model's weights rewritten in place and both
    servers restarted (the kvstore service, with the old weights' chunks in DRAM, stays):
    the new engine must load none of them."""
    if target.swap_weights is None:
        raise NotAvailable("needs the servers kvstore verify starts (it rewrites their model in place)")
    prompt = prompt_token_ids(4 * target.chunk_tokens + 1, seed=91, vocab=VOCAB)
    _complete(target.url, target.model, prompt)  # stored
    full = _floor(len(prompt) - 1, target.chunk_tokens)
    if _complete(target.url, target.model, prompt).cached_tokens != full:
        raise AssertionError("the prompt was not stored under the old weights")
    target.swap_weights()
    expected = _complete(target.reference_url, target.model, prompt)
    return "other weights, same path: " + check(_complete(target.url, target.model, prompt), expected, 0)


CASES: tuple[tuple[str, Callable[[Target], str]], ...] = (
    ("images", case_images), ("image offsets", case_image_offsets), ("lora", case_lora),
    ("cache salt", case_cache_salt), ("long prompt", case_long_prompt), ("killed write", case_killed_write),
    ("disk full", case_disk_full), ("weights", case_weights))


def run_cases(target: Target, names: list[str]) -> list[Result]:
    results = []
    for name, case in CASES:
        if name not in names:
            continue
        print(f"{name} ...", flush=True)
        try:
            results.append(Result(name, "pass", case(target)))
        except NotAvailable as exc:
            results.append(Result(name, "not available", str(exc)))
        except AssertionError as exc:
            results.append(Result(name, "FAIL", str(exc)))
        print(f"  {results[-1].outcome}: {results[-1].detail}", flush=True)
    return results


@contextlib.contextmanager
def own_servers(workdir: Path, long_chunks: int) -> Iterator[Target]:
    """A reference and a kvstore server on the tiny LLaVA with a LoRA adapter (without it,
    and the reason, where vLLM will not serve one)."""
    model = build_tiny_llava(workdir / "llava")
    lora = build_tiny_lora(workdir / "lora", model)
    args = [*SERVER_ARGS, "--max-model-len", str((long_chunks + 8) * CHUNK)]
    lora_args = ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{LORA}={lora}"]
    config = {"chunk_tokens": CHUNK, "tiers": {"dram": {"capacity": "1GiB"},
                                               "disk": [{"path": str(workdir / "disk"), "capacity": "1GiB"}]},
              "service": {"socket": str(workdir / "kvstore.sock"), "staging": "32MiB"},
              "write_policy": "write_through"}  # chunks reach disk as they are stored (killed write)
    store = load_config(config)
    stop_service(store)
    env = server_env(model)
    problem = None
    try:
        with contextlib.ExitStack() as servers:
            try:
                reference = servers.enter_context(OpenAIServer(
                    model, [*args, *lora_args], workdir / "reference.log", kv_cache_gib=1, env=env))
            except RuntimeError as exc:
                problem = f"vLLM would not serve the LoRA adapter: {str(exc)[-300:]}"
                print(problem, flush=True)
                lora_args = []
                reference = servers.enter_context(OpenAIServer(model, args, workdir / "reference.log",
                                                               kv_cache_gib=1, env=env))
            server = servers.enter_context(OpenAIServer(
                model, [*args, *lora_args], workdir / "kvstore.log", connector={"config": config},
                kv_cache_gib=1, env=env))

            def swap_weights() -> None:
                server.stop()
                reference.stop()
                build_tiny_llava(workdir / "llava", seed=1)  # the same path, other weights
                reference.start()
                server.start()

            yield Target(server.url, reference.url, "vlm", store, CHUNK, long_chunks, problem, swap_weights)
    finally:
        stop_service(store)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="a running vLLM OpenAI server with kvstore (default: start one, "
                        "and a reference, on a tiny LLaVA)")
    parser.add_argument("--reference-url", help="with --url: a server of the same model without kvstore")
    parser.add_argument("--model", default="vlm", help="with --url: the served model name")
    parser.add_argument("--config", help="with --url: the kvstore server's config (the killed-write "
                        "case needs it)")
    parser.add_argument("--chunk-tokens", type=int, help="with --url and no --config: the server's "
                        "chunk size")
    parser.add_argument("--long-chunks", type=int, default=160, help="chunks in the long prompt (> 128)")
    parser.add_argument("--cases", default=",".join(name for name, _ in CASES), help="which cases, by name")
    parser.add_argument("--workdir", help="without --url: the model, tiers and logs (kept)")
    parser.add_argument("--json", help="also write the results here")


def run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    if args.url:
        if not args.reference_url:
            print("kvstore verify: --url needs --reference-url (a server of the same model without kvstore)")
            return 2
        store = load_config(args.config) if args.config else None
        chunk = args.chunk_tokens or (store.chunk_tokens if store is not None else CHUNK)
        results = run_cases(Target(args.url, args.reference_url, args.model, store, chunk, args.long_chunks),
                            names)
    else:
        with run_workdir(args.workdir, "kvstore-verify-") as workdir, \
                own_servers(workdir, args.long_chunks) as target:
            results = run_cases(target, names)
    print(f"\n{'case':<15} {'result':<14} detail")
    for result in results:
        print(f"{result.case:<15} {result.outcome:<14} {result.detail}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 1 if any(r.outcome == "FAIL" for r in results) else 0
