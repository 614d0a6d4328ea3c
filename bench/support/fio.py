"""fio on the same file, block size and depth: the yardstick for the disk tier.

A weak yardstick is a wrong figure, so each sitting keeps every fio run it made and
compares cases with the best of them: fio into huge-page buffers (`--iomem=shmhuge`,
whole requests) and into malloc'd ones (split at the device's segment limit), the
two alternated between the cases they bracket, so drift over the sitting shows.

fio reads each request into one of `depth` buffers, reused read after read: at a low
depth they stay in the CPU's cache, and where the disk is virtual (its host copies into
the guest's memory) that is what fio then measures. On the development machine one to
four 2 MiB buffers read 3.0-3.2 GiB/s and 64 of them 2.5, at any depth (kvstore's own
engine, the same file). A KV load lands every chunk in memory of its own, so a load is
held to the runs whose buffers outgrow the cache (`cache_cold`).
"""

from __future__ import annotations

import ctypes
import json
import shutil
import signal
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.support.vm import huge_page_bytes, huge_pages

HUGE = "shmhuge"
MALLOC = "malloc"
SYSV_SHM = Path("/proc/sysvipc/shm")
CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
IPC_RMID = 0


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
        # The job as a thread of fio's one process (a forked job is a session of its own):
        # ending fio on Ctrl-C then ends the job and frees its huge pages.
        "--thread",
    ]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as fio:
        try:
            stdout, stderr = fio.communicate(timeout=runtime_s + 60)
        except BaseException:  # Ctrl-C, SIGTERM, a hung fio
            _stop(fio)
            raise
    if fio.returncode != 0:
        lines = (stderr or stdout).strip().splitlines()
        return f"fio --iomem={iomem} failed: {lines[0] if lines else f'exit {fio.returncode}'}"
    job = json.loads(stdout)["jobs"][0]
    read = job["read"]
    seconds = read["runtime"] / 1000 or runtime_s
    gib = read["io_bytes"] / 2**30
    cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100 * seconds
    return FioRun(geometry.label, geometry.block, queue_depth, iomem, gib / seconds,
                  cpu_s / gib if gib else float("nan"))


def last_level_cache_bytes() -> int:
    """The largest of the CPU's caches (sysfs: "32768K"), 0 where the kernel does not say."""
    sizes = [0]
    for index in CPU_CACHES.glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        shift = {"K": 10, "M": 20, "G": 30}.get(size[-1:], 0)
        digits = size[:-1] if shift else size
        if digits.isdigit():
            sizes.append(int(digits) << shift)
    return max(sizes)


def cache_cold(block: int, queue_depth: int, cache_bytes: int) -> bool:
    """Whether fio's buffers at this depth (depth x block) are at least twice the CPU's
    cache, so that its reads land in memory the CPU does not hold, as a load's do."""
    return block * queue_depth >= 2 * cache_bytes


def _stop(fio: subprocess.Popen[str]) -> None:
    """End fio as Ctrl-C would (it then frees its buffers), by force if it lingers; a
    huge-page segment that a killed fio leaves behind is removed (it would hold its
    pages until reboot)."""
    fio.send_signal(signal.SIGINT)
    try:
        fio.wait(timeout=10)
    except subprocess.TimeoutExpired:
        fio.kill()
        fio.wait()
    try:
        segments = SYSV_SHM.read_text().splitlines()[1:]
    except OSError:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for line in segments:
        fields = line.split()  # key shmid perms size cpid lpid nattch ...
        if int(fields[4]) == fio.pid and int(fields[6]) == 0:
            libc.shmctl(int(fields[1]), IPC_RMID, None)


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
