"""fio on the same file, block size and depth: the yardstick for the disk tier."""

from __future__ import annotations

import json
import shutil
import subprocess


def fio_randread(path: str, offset: int, size: int, block: int, queue_depth: int,
                 runtime_s: float, iomem: str = "malloc") -> dict[str, float] | None:
    """fio io_uring O_DIRECT randread; None when fio is not installed or fails."""
    if shutil.which("fio") is None:
        return None
    command = [
        "fio", "--name=kvstore-baseline", f"--filename={path}", "--rw=randread",
        f"--bs={block}", "--direct=1", "--ioengine=io_uring", f"--iodepth={queue_depth}",
        f"--offset={offset}", f"--size={size}", f"--runtime={runtime_s}", "--time_based",
        f"--iomem={iomem}", "--output-format=json", "--numjobs=1",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=runtime_s + 60)
    if done.returncode != 0:
        return None
    job = json.loads(done.stdout)["jobs"][0]
    read = job["read"]
    seconds = read["runtime"] / 1000 or runtime_s
    gib = read["io_bytes"] / 2**30
    cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100 * seconds
    return {"read_gibps": gib / seconds, "cpu_s_per_gib_read": cpu_s / gib if gib else float("nan")}
