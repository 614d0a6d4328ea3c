"""Run prompts through one fresh vLLM engine and print what happened, as JSON.

Each call is its own process on purpose: vLLM's own prefix cache lives as long as
the engine, so only a fresh process shows what kvstore supplies. Used by the
end-to-end tests, the README demo and `kvstore ttft`.

  python -m bench.support.engine_run --model DIR --prompts prompts.json [--connector JSON]
      [--single-process] [--max-num-batched-tokens N] [--max-tokens 8] [--busy busy.json]
      [--kv-events ENDPOINT] [--reset-before I ...]
  python -m bench.support.engine_run --fork-server SOCKET   (engine_fork.py: runs forked
      from one process that has imported vLLM, ~6 s less each; see start_fork_server)

Prompts run one at a time (TTFT of a request alone), unless --busy names prompts to
submit first: then the busy prompts and all measured prompts go in at once, and the
measured ones queue behind a busy engine (results are for the measured ones only).
--reset-before resets vLLM's prefix cache with the connector's before those prompts (as
vLLM's weight-update flow does: `reset_prefix_cache(reset_connector=True)`).

prints {"results": [{"token_ids": [...], "num_cached_tokens": n, "logprobs": [...],
"top_logprobs": [[[id, logprob], ...], ...], "ttft_s": t}, ...]}
(logprobs: of each generated token; top_logprobs: per generated token, the engine's top 5
and the chosen one, as vLLM's own tests compare two runs; run_fresh returns them as
{token id: logprob} per token)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.support.engine_fork import SOCKET_ENV, ForkedRun, fork_run, serve

RESULT_PREFIX = "KVSTORE_RESULT "
TOP_LOGPROBS = 5


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": args.model, "dtype": args.dtype, "max_model_len": args.max_model_len,
        "enforce_eager": True, "disable_log_stats": False, "seed": 0,
        "enable_prefix_caching": not args.no_prefix_caching, "kv_cache_dtype": args.kv_cache_dtype,
    }
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
        kwargs["enable_chunked_prefill"] = True
    if args.single_process:
        kwargs["distributed_executor_backend"] = "uni"
    if args.connector is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "TieredKVConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": json.loads(args.connector)}
        if args.module_path:  # find the class by module, not through the plugin's registration
            kwargs["kv_transfer_config"]["kv_connector_module_path"] = "engine_plugin.vllm.connector"
    if args.kv_events:  # what a KV-aware router hears: the engine's and kvstore's KV events
        from vllm.config.kv_events import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                    endpoint=args.kv_events)
    return kwargs


def import_engine() -> None:
    """Import vLLM as a run does (engine_fork.py does it once for many runs)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM  # noqa: F401


def _import_for_runs() -> None:
    """What runs import before their engine starts: vLLM and, for runs with one, kvstore's
    connector."""
    import_engine()
    import engine_plugin.vllm.connector  # noqa: F401


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.single_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import_engine()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.prompts) as f:
        prompts = json.load(f)
    llm = LLM(**_engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=TOP_LOGPROBS)
    if args.busy:
        with open(args.busy) as f:
            busy = json.load(f)
        started = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=t) for t in busy + prompts], params,
                               use_tqdm=False)
        wall = time.perf_counter() - started
        return {"results": [_result(output, wall) for output in outputs[len(busy):]]}
    hints = [None] * len(prompts)
    if args.hints:
        with open(args.hints) as f:
            hints = json.load(f)
    results = []
    for index, (tokens, hint) in enumerate(zip(prompts, hints, strict=True)):  # one at a time: TTFT alone
        if index in args.reset_before:
            llm.reset_prefix_cache(reset_connector=True)
        request_params = params
        if hint:  # tokens a later request will start with (engine_plugin/vllm/core/prefetch.py: hints)
            request_params = params.clone()
            request_params.extra_args = {"kv_transfer_params": {"kvstore_prefetch_token_ids": hint}}
        started = time.perf_counter()
        output = llm.generate([TokensPrompt(prompt_token_ids=tokens)], request_params, use_tqdm=False)[0]
        results.append(_result(output, time.perf_counter() - started))
    return {"results": results}


def _result(output: Any, wall: float) -> dict[str, Any]:
    """TTFT from the request's arrival (vLLM's own metric), which includes queueing."""
    ttft = getattr(output.metrics, "first_token_latency", 0.0) or wall
    completion = output.outputs[0]
    steps = completion.logprobs or []
    logprobs = [step[token].logprob for step, token in zip(steps, completion.token_ids, strict=False)]
    top = [[[token, entry.logprob] for token, entry in step.items()] for step in steps]
    return {"token_ids": list(completion.token_ids), "num_cached_tokens": output.num_cached_tokens,
            "logprobs": logprobs, "top_logprobs": top, "ttft_s": ttft, "wall_s": wall}


CHECKOUT = Path(__file__).resolve().parents[2]  # the checkout this runner is in


def _run_env() -> dict[str, str]:
    """A run's environment: this process's, offline, with a small CPU KV cache unless set."""
    return dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                HF_HUB_OFFLINE="1")


def start_fork_server(path: str | Path, log: Any = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
    """Start a server that forks this process's later runs (engine_fork.py) and point
    KVSTORE_ENGINE_FORK at it; it serves once it has imported vLLM (until then, and if
    it dies, runs start as processes of their own). The caller kills it."""
    os.environ[SOCKET_ENV] = str(path)  # before the server starts: a run's environment must match its
    return subprocess.Popen([sys.executable, "-m", "bench.support.engine_run", "--fork-server", str(path)],
                            env=_run_env(), cwd=CHECKOUT, stdout=log, stderr=log, start_new_session=True)


@dataclass
class EngineRun:
    returncode: int
    output: str
    results: list[dict[str, Any]]
    forked: bool = False  # from a fork server (engine_fork.py), not a process started cold


def run_fresh(model: str | Path, prompts_file: str | Path, connector: dict[str, Any] | None = None,
              *, single_process: bool = False, max_num_batched_tokens: int | None = None,
              max_model_len: int = 4096, module_path: bool = False, timeout_s: float = 600,
              check: bool = True, busy_file: str | Path | None = None,
              hints_file: str | Path | None = None, kv_events: str | None = None,
              kv_cache_dtype: str = "auto", dtype: str = "float16",
              reset_before: Sequence[int] = (), checkout: Path = CHECKOUT) -> EngineRun:
    """Run this module in a new process (a cold engine) and parse its result line; with
    another `checkout`, that checkout's runner and connector (its runner sat in
    engine_plugin/ before each engine had its room there)."""
    runner = ("bench.support.engine_run" if (checkout / "bench" / "support" / "engine_run.py").is_file()
              else "engine_plugin.engine_run")
    command = [sys.executable, "-m", runner, "--model", str(model),
               "--prompts", str(prompts_file), "--max-model-len", str(max_model_len),
               "--kv-cache-dtype", kv_cache_dtype, "--dtype", dtype]
    if busy_file is not None:
        command += ["--busy", str(busy_file)]
    if hints_file is not None:
        command += ["--hints", str(hints_file)]
    if kv_events is not None:
        command += ["--kv-events", kv_events]
    if reset_before:
        command += ["--reset-before", *map(str, reset_before)]
    if connector is not None:
        command += ["--connector", json.dumps(connector)]
    if single_process:
        command.append("--single-process")
    if module_path:
        command.append("--module-path")
    if max_num_batched_tokens:
        command += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    env, cwd = _run_env(), str(checkout)
    # Its own process group: on a timeout the engine's core and worker processes go
    # too, instead of living on as orphans that busy-poll a CPU each. Forked from a
    # server that has imported vLLM where there is one (engine_fork.py, this checkout's), as fresh.
    process: ForkedRun | subprocess.Popen[str] | None = (
        fork_run(command[3:], env, cwd) if checkout == CHECKOUT else None)
    if process is None:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=env, cwd=cwd, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # it ended just now
            os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise RuntimeError(f"engine run passed its {timeout_s:.0f} s deadline:\n{stderr[-4000:]}") from None
    done = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    results = []
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            results = json.loads(line[len(RESULT_PREFIX):])["results"]
    for result in results:
        result["top_logprobs"] = [{int(token): value for token, value in step}
                                  for step in result.get("top_logprobs", ())]
    output = done.stdout + done.stderr
    if check and (done.returncode != 0 or not results):
        raise RuntimeError(f"engine run failed (rc={done.returncode}):\n{output[-4000:]}")
    return EngineRun(done.returncode, output, results, isinstance(process, ForkedRun))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    parser.add_argument("--connector", help="kv_connector_extra_config as JSON (omit: no kvstore)")
    parser.add_argument("--module-path", action="store_true",
                        help="load the connector via kv_connector_module_path")
    parser.add_argument("--single-process", action="store_true",
                        help="scheduler and worker in this process (default: vLLM's multi-process)")
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--dtype", default="float16", help="float16 or bfloat16 "
                        "(bench/support/cpu_dtypes.py)")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype (auto, fp8, ...)")
    parser.add_argument("--busy", help="JSON token-id lists submitted ahead of the prompts, all at once")
    parser.add_argument("--hints", help="JSON: per prompt, token ids to hint with it (or null)")
    parser.add_argument("--reset-before", type=int, nargs="*", default=[], metavar="I",
                        help="reset vLLM's prefix cache with the connector's before prompt I")
    parser.add_argument("--kv-events", help="publish KV events over ZMQ at this endpoint (e.g. "
                                            "ipc:///tmp/kv-events; a tcp:// one with a host connects)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    result = run(build_parser().parse_args(argv))
    sys.stdout.flush()
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--fork-server"]:
        serve(sys.argv[2], _import_for_runs, main)
    sys.exit(main())
