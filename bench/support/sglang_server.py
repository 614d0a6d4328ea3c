"""SGLang's own HTTP server as a child process, with HiCache and a storage backend, and its requests.

The server runs in .venv-sglang (scripts/setup_sglang.sh) on the CPU, through
bench/support/sglang_cpu.py's stand-ins, with HiCache on: the device KV pool, a host pool in
`layer_first` or `page_first` layout (moved with the `direct` io backend), and a storage
backend, kvstore's (`dynamic`, engine_plugin.sglang.hicache.KVStoreHiCache) or SGLang's own
`file` (HiCacheFile). It waits, with a deadline, until /health answers and on stop kills
the whole process group, scheduler and detokenizer included. Prefetches from storage
run to completion (`wait_complete`), so what a request reports loaded does not depend on
how busy the machine is. Requests are plain HTTP: /generate (token ids in, greedy ids
and top-5 logprobs out, streamed for the time to the first token) and /v1/chat/completions
(SGLang's `sglext` carries the prompt's and the answer's token ids and where the cached
prompt tokens came from: `device`, `host`, `storage`).

Answers are compared as vLLM's tests compare them (bench/support/answers.py): a Generation is an
Answer of its output ids, a ChatTurn of its tokens as text.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.support.openai_server import ChatReply, stream_events
from bench.support.processes import ROOT, free_port, start_group, stop_group, wait_healthy
from bench.support.tiny_model import prompt_token_ids
from connectors.link import RECONNECT_INTERVAL_S

SGLANG_VENV = ROOT / ".venv-sglang"
VOCAB = 49152  # the chat model's (SmolLM2)
PAGE_TOKENS = 16  # SGLang's page: one page of the host pool is one kvstore chunk
TOP_LOGPROBS = 5
START_TIMEOUT_S = 400.0
# SGLang's server on the CPU (bench/support/sglang_cpu.py says why each of these), HiCache with the
# `direct` io backend, a small device pool and host pool (two servers fit beside each
# other on a 24 GiB machine), no warm-up request of its own (callers send theirs), and an
# idle scheduler that sleeps (by default it polls, taking a whole core from the others).
SERVER_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
               "--disable-cuda-graph", "--mem-fraction-static", "0.3", "--max-total-tokens", "8192",
               "--enable-hierarchical-cache", "--hicache-io-backend", "direct",
               "--page-size", str(PAGE_TOKENS), "--hicache-size", "1",
               "--hicache-storage-prefetch-policy", "wait_complete", "--skip-server-warmup",
               "--sleep-on-idle"]
ENV = {"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "SGLANG_DISABLE_REQUEST_LOGGING": "1"}


def sglang_python() -> Path | None:
    """.venv-sglang's Python, or None where scripts/setup_sglang.sh has not built it."""
    if not (SGLANG_VENV / ".kvstore-installed").is_file():
        return None
    return SGLANG_VENV / "bin" / "python"


def kvstore_store(work: Path, dram: str = "256MiB", disk: str = "512MiB") -> tuple[dict[str, Any], Path]:
    """A kvstore config for the servers' backend under `work` (a DRAM tier over a disk
    tier, written through; the service is spawned by the first backend that needs it),
    and the file SGLang's extra config names."""
    store = {"tiers": {"dram": {"capacity": dram}, "disk": [{"path": str(work / "disk"), "capacity": disk}]},
             "write_policy": "write_through", "io": {"timeout_s": 5.0},
             "service": {"socket": str(work / "run" / "kv.sock"), "staging": "64MiB"}}
    config = work / "kvstore.yaml"
    config.write_text(yaml.safe_dump(store))
    return store, config


def kvstore_backend(config: str | Path, prefetch_threshold: int | None = None) -> list[str]:
    """The flags that make kvstore HiCache's storage backend (docs/sglang.md). SGLang
    looks in storage only for a prompt whose uncached part reaches `prefetch_threshold`
    tokens (its extra config's key; SGLang's default 256)."""
    extra: dict[str, Any] = {"backend_name": "kvstore", "module_path": "engine_plugin.sglang.hicache",
                             "class_name": "KVStoreHiCache", "interface_v1": 1, "config": str(config)}
    if prefetch_threshold is not None:
        extra["prefetch_threshold"] = prefetch_threshold
    return ["--hicache-storage-backend", "dynamic",
            "--hicache-storage-backend-extra-config", json.dumps(extra)]


def file_backend(directory: str | Path, prefetch_threshold: int | None = None) -> list[str]:
    """SGLang's own file backend (HiCacheFile: one file per page) in `directory`."""
    extra: dict[str, Any] = {"file_storage_path": str(directory)}
    if prefetch_threshold is not None:
        extra["prefetch_threshold"] = prefetch_threshold
    return ["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", json.dumps(extra)]


@dataclass
class Generation:
    output_ids: list[int]
    top: list[dict[Hashable, float]]  # per output token: the top-5 tokens and their logprobs
    details: dict[str, Any]  # meta_info.cached_tokens_details: device, host, storage tokens
    ttft_s: float  # request sent -> first output token received
    seconds: float

    @property
    def storage(self) -> int:
        """Prompt tokens the storage backend served."""
        return int(self.details.get("storage") or 0)

    @property
    def token_ids(self) -> list[int]:
        return self.output_ids

    @property
    def top_logprobs(self) -> list[dict[Hashable, float]]:
        return self.top


@dataclass
class ChatTurn(ChatReply):
    """A chat turn (its `cached_tokens`: device + host + storage) with where the cached
    prompt tokens came from, and the answer's tokens as text with each one's top-5."""

    details: dict[str, Any] = field(default_factory=dict)
    tokens: list[str] = field(default_factory=list)
    top: list[dict[Hashable, float]] = field(default_factory=list)

    @property
    def storage(self) -> int:
        return int(self.details.get("storage") or 0)


class SGLangServer:
    """One server; use as a context manager, or call start() and stop()."""

    def __init__(self, python: str | Path, model: str | Path, backend: list[str], log_path: str | Path, *,
                 layout: str = "layer_first", args: Sequence[str] = ()) -> None:
        self.model = str(model)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.command = [str(python), "-m", "bench.support.sglang_cpu", "--model-path", self.model,
                        "--served-model-name", "chat", "--host", "127.0.0.1", "--port", str(self.port),
                        *SERVER_ARGS, "--hicache-mem-layout", layout, *backend, *args]
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self.env = {**os.environ, **ENV, "PYTHONPATH": path}
        self.process: Any = None
        self.shm_before: set[str] = set()

    def __enter__(self) -> SGLangServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the server and wait until it answers /health; on failure or past the
        deadline the process group is killed and the error carries the log's tail."""
        self.shm_before = shm_leftovers()
        self.process = start_group(self.command, self.log_path, self.env)
        problem = wait_healthy(self.url, self.process, timeout_s)
        if problem is not None:
            self.stop()
            tail = self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""
            raise RuntimeError(f"SGLang server {problem}:\n{tail}")

    def stop(self, timeout_s: float = 30) -> None:
        if self.process is not None:
            stop_group(self.process, timeout_s)
            remove_shm_leftovers(self.shm_before)
        self.process = None

    def generate(self, input_ids: list[int], max_new_tokens: int = 8, timeout_s: float = 600) -> Generation:
        """Greedy tokens for a token-id prompt (ignoring EOS: exactly max_new_tokens), streamed."""
        body = {"input_ids": input_ids, "stream": True, "return_logprob": True,
                "top_logprobs_num": TOP_LOGPROBS,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
        started = time.perf_counter()
        first, last = None, {}
        for at, event in stream_events(self.url + "/generate", body, timeout_s):
            if first is None and event.get("output_ids"):
                first = at
            last = event
        seconds = time.perf_counter() - started
        meta = last.get("meta_info") or {}
        top: list[dict[Hashable, float]] = [{int(entry[1]): float(entry[0]) for entry in position or ()}
                                            for position in meta.get("output_top_logprobs") or ()]
        details = dict(meta.get("cached_tokens_details") or {})
        return Generation(list(last.get("output_ids") or ()), top, details,
                          first if first is not None else seconds, seconds)

    def chat(self, messages: list[dict[str, str]], max_tokens: int = 48, timeout_s: float = 600) -> ChatTurn:
        """One greedy chat turn through /v1/chat/completions and the model's chat template."""
        body = {"model": "chat", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                "logprobs": True, "top_logprobs": TOP_LOGPROBS, "return_cached_tokens_details": True,
                "return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True}
        started = time.perf_counter()
        answer = post(self.url + "/v1/chat/completions", body, timeout_s)
        seconds = time.perf_counter() - started
        choice = answer["choices"][0]
        sglext = choice.get("sglext") or answer.get("sglext") or {}
        details = dict(sglext.get("cached_tokens_details") or {})
        content = (choice.get("logprobs") or {}).get("content") or []
        return ChatTurn(choice["message"]["content"] or "", list(sglext.get("input_ids") or ()),
                        list((sglext.get("output_ids") or [[]])[0]),  # one list per choice
                        sum(int(details.get(source) or 0) for source in ("device", "host", "storage")),
                        seconds, seconds, details=details, tokens=[entry["token"] for entry in content],
                        top=[{top["token"]: float(top["logprob"]) for top in entry.get("top_logprobs") or ()}
                             for entry in content])


def post(url: str, body: dict[str, Any], timeout_s: float) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return json.load(reply)
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"HTTP {exc.code}: {exc.read()[:2000]!r}") from None


def reconnect(*servers: SGLangServer) -> None:
    """After a kvstore service restart: each server's next storage lookup finds its
    connection gone (a miss) and its backend reconnects, respawning the service, on a
    lookup at least RECONNECT_INTERVAL_S later. So each answers a 4-page prompt (looked
    up where the servers' prefetch_threshold is at most that), then the interval passes."""
    probe = prompt_token_ids(4 * PAGE_TOKENS, seed=99, vocab=VOCAB)
    for server in servers:
        server.generate(probe, 1)
    time.sleep(RECONNECT_INTERVAL_S + 1)


SHM = Path("/dev/shm")
SHM_KINDS = ("sglang_loads_", "sem.mp-")  # SGLang's load-snapshot slots, multiprocessing's semaphores


def shm_leftovers() -> set[str]:
    return {p.name for p in SHM.iterdir() if p.name.startswith(SHM_KINDS)} if SHM.is_dir() else set()


def remove_shm_leftovers(before: set[str]) -> None:
    """SGLang's processes are killed, not unlinking what they made in /dev/shm (its own CI
    sweeps it: sglang/srt/utils/stale_shm_cleanup.py). Removes the files of those kinds
    made since `before` that no live process maps or holds open (another server's stay,
    and so do other programs' multiprocessing semaphores). In use is judged by inode, not
    name: a semaphore is mapped under the temporary name it was made with
    (/dev/shm/sem.XXXXXX, deleted once linked to its sem.mp-* name)."""
    made: dict[int, str] = {}
    for name in shm_leftovers() - before:
        with contextlib.suppress(OSError):
            made[(SHM / name).stat().st_ino] = name
    if not made:
        return
    in_use: set[int] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)  # address perms offset dev inode path
                if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                    in_use.add(int(fields[4]))
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd).startswith("/dev/shm/"):
                        in_use.add(os.stat(fd).st_ino)
    for inode, name in made.items():
        if inode not in in_use:
            with contextlib.suppress(OSError):
                (SHM / name).unlink()

