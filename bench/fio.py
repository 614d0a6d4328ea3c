"""fio on the same file, block size and depth: the yardstick for the disk tier.

A weak yardstick is a wrong figure, so each sitting keeps every fio run it made and
compares cases with the best of them: fio into huge-page buffers (`--iomem=shmhuge`,
whole requests) and into malloc'd ones (split at the device's segment limit), the
two alternated between the cases they bracket, so drift over the sitting shows.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import asdict, dataclass

from bench.vm import huge_page_bytes, huge_pages

HUGE = "shmhuge"
MALLOC = "malloc"


@dataclass(frozen=True)
class Geometry:
    """Where a case's records lie: fio reads the same slots in blocks of one slot."""

    label: str  # the case's tier, as the table names it ("disk", "nvmeof x1")
    file: str
    offset: int
    size: int
    block: int


@dataclass
class FioRun:
    label: str
    block: int
    queue_depth: int
    iomem: str
    read_gibps: float
    cpu_s_per_gib_read: float


def fio_randread(geometry: Geometry, queue_depth: int, runtime_s: float,
                 iomem: str) -> FioRun | str:
    """fio io_uring O_DIRECT randread over the geometry's slots; why not, as a string,
    when fio is missing or fails."""
    if shutil.which("fio") is None:
        return "fio is not installed"
    command = [
        "fio", "--name=kvstore-baseline", f"--filename={geometry.file}", "--rw=randread",
        f"--bs={geometry.block}", "--direct=1", "--ioengine=io_uring", f"--iodepth={queue_depth}",
        f"--offset={geometry.offset}", f"--size={geometry.size}", f"--runtime={runtime_s}",
        "--time_based", f"--iomem={iomem}", "--output-format=json", "--numjobs=1",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=runtime_s + 60)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return f"fio --iomem={iomem} failed: {lines[0] if lines else f'exit {done.returncode}'}"
    job = json.loads(done.stdout)["jobs"][0]
    read = job["read"]
    seconds = read["runtime"] / 1000 or runtime_s
    gib = read["io_bytes"] / 2**30
    cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100 * seconds
    return FioRun(geometry.label, geometry.block, queue_depth, iomem, gib / seconds,
                  cpu_s / gib if gib else float("nan"))


class Yardstick:
    """The fio runs of one sitting, per (tier label, block, depth)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.runs: list[FioRun] = []
        self.notes: list[str] = []  # why a kind of fio run is missing, once each
        self._huge_next = True

    def measure(self, geometry: Geometry, queue_depth: int) -> FioRun | None:
        """One fio run, huge pages and malloc in turn (malloc only where huge pages
        cannot be had); None when it could not run (the reason is noted)."""
        iomem = HUGE if self._huge_next else MALLOC
        self._huge_next = not self._huge_next
        if iomem == HUGE:
            # fio rounds its buffer (block x depth) up to whole huge pages, plus one.
            need = geometry.block * queue_depth + 2 * max(huge_page_bytes(), 1)
            with huge_pages(need) as why_not:
                run = (fio_randread(geometry, queue_depth, self.seconds, HUGE) if why_not is None
                       else f"fio with huge pages: {why_not}")
        else:
            run = fio_randread(geometry, queue_depth, self.seconds, MALLOC)
        if isinstance(run, FioRun):
            self.runs.append(run)
            return run
        if run not in self.notes:
            self.notes.append(run)
        return None

    def best(self, label: str, block: int, queue_depth: int, iomem: str | None = None) -> FioRun | None:
        """The fastest run at this geometry (of one buffer kind, or of both)."""
        runs = [r for r in self.runs if (r.label, r.block, r.queue_depth) == (label, block, queue_depth)
                and iomem in (None, r.iomem)]
        return max(runs, key=lambda r: r.read_gibps, default=None)

    def rows(self) -> list[dict[str, object]]:
        return [asdict(run) for run in self.runs]
