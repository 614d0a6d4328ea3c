"""Which dtypes the engine runs of the tests, `kvstore demo` and `kvstore ttft` check on
this CPU: float16 everywhere, and bfloat16 as well on CPUs with AMX (`amx_tile` in
/proc/cpuinfo). There vLLM's CPU attention takes its AMX kernel for bfloat16, a path of
its own (a fresh engine's first kvstore hit crashed it: docs/vllm.md, "bfloat16 on AMX
CPUs"); elsewhere bfloat16 runs the same vector kernels as float16, so a second run would
cost time and check nothing new.
"""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
BF16_SKIP_REASON = ("bfloat16 is checked on CPUs with AMX (amx_tile in /proc/cpuinfo), where vLLM's "
                    "CPU attention has a kernel of its own for it; this CPU has none")


def has_amx_tile(cpuinfo: Path = CPUINFO) -> bool:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and "amx_tile" in line.split() for line in text.splitlines())


def checked_dtypes() -> tuple[str, ...]:
    return ("float16", "bfloat16") if has_amx_tile() else ("float16",)
