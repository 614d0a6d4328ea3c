"""AMX tile state for a vLLM CPU worker, asked of Linux before the first kvstore load.

Linux gives a process the AMX tile registers (XTILEDATA, xstate feature 18) only after
it asks: `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`; an AMX instruction run
before that raises SIGILL. Nothing in vLLM 0.32's CPU worker asks. oneDNN does, the first
time it picks an AMX GEMM, which a fresh engine's first prefill (many tokens) does, so
vLLM alone never notices. A kvstore hit changes the first forward pass: the prefix is
loaded and the engine computes the last token(s) only; the GEMMs for so few rows take no
AMX path, and vLLM's CPU attention, whose bfloat16 kernel on an AMX CPU uses tiles
(`cpu_attention_with_kv_cache`, ISA "amx"), then runs first and dies with SIGILL.

The connector's worker asks once, when vLLM hands it the KV caches (before any forward
pass that reads them). Asking is what oneDNN itself does, costs one syscall, and holds
for every thread of the process; warming the kernel instead would mean running vLLM's
attention on made-up inputs of the right shapes, which is slower and breaks when vLLM's
kernel selection changes. Where the CPU or kernel has no AMX the answer says so and
nothing changes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_GET_XCOMP_SUPP = 0x1021
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
log = logging.getLogger("vllm.kvstore")


def ready_cpu_worker(device_type: str, rank: int) -> None:
    """The connector's worker on a CPU device asks for AMX tile state and logs the answer."""
    if device_type == "cpu":
        log.info("kvstore worker rank %d: AMX tile state %s", rank, request_amx_tile_state())


def request_amx_tile_state() -> str:
    """Ask for AMX tile state for this process: "granted", or why not (no AMX here, not
    x86-64 Linux, or the kernel's refusal). Idempotent; never raises."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return "not needed (not x86-64 Linux)"
    supported = ctypes.c_uint64(0)
    error = _arch_prctl(ARCH_GET_XCOMP_SUPP, ctypes.byref(supported))
    if error is not None:
        return f"unavailable: {error}"
    if not supported.value & (1 << XFEATURE_XTILEDATA):
        return "unavailable: this CPU or kernel has no AMX tile state"
    error = _arch_prctl(ARCH_REQ_XCOMP_PERM, ctypes.c_long(XFEATURE_XTILEDATA))
    if error is not None:
        return f"refused: {error}"
    return "granted" if amx_tile_permitted() else "refused: not permitted after the request"


def amx_tile_permitted() -> bool:
    """Whether this process may use AMX tile state now (ARCH_GET_XCOMP_PERM)."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    permitted = ctypes.c_uint64(0)
    return (_arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.byref(permitted)) is None
            and bool(permitted.value & (1 << XFEATURE_XTILEDATA)))


def _arch_prctl(request: int, argument: object) -> str | None:
    """The arch_prctl system call: None, or the error it returned."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(request), argument) != 0:
        return os.strerror(ctypes.get_errno())
    return None
