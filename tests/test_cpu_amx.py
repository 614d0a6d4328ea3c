"""The worker's request for AMX tile state (engine_plugin/vllm/cpu_amx.py), made for real.

Linux grants AMX tile state per process; ARCH_GET_XCOMP_PERM reads what this process may
use. Each case runs in a fresh Python, so nothing this test process did (torch's oneDNN
asks on its own once it runs an AMX GEMM) is inherited. Whether the worker of a real
engine asks is checked in tests/test_vllm_e2e.py (its log line).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.support.cpu_dtypes import has_amx_tile

ROOT = Path(__file__).resolve().parent.parent
PROBE = """
import json
from engine_plugin.vllm.cpu_amx import amx_tile_permitted, request_amx_tile_state
before = amx_tile_permitted()
answer = request_amx_tile_state()
print(json.dumps({"before": before, "answer": answer, "after": amx_tile_permitted(),
                  "again": request_amx_tile_state()}))
"""


def _fresh_probe() -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                          check=True, timeout=60)
    return json.loads(done.stdout)


def test_the_request_grants_amx_tile_state_where_the_cpu_has_it():
    probe = _fresh_probe()
    assert probe["before"] is False  # a fresh process has not asked
    if has_amx_tile():
        assert probe == {"before": False, "answer": "granted", "after": True, "again": "granted"}
    else:  # asked all the same, and told why nothing changed
        assert probe["answer"].startswith("unavailable:"), probe
        assert probe["after"] is False and probe["again"] == probe["answer"]


def test_cpuinfo_flags_decide_the_bf16_runs(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n")
    assert has_amx_tile(cpuinfo)
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\nbugs\t\t: amx_tile_x\n")
    assert not has_amx_tile(cpuinfo)
    assert not has_amx_tile(tmp_path / "absent")
