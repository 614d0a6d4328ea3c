"""Stand-ins for NVMe-oF namespaces on a machine without a fabric: loop devices with
O_DIRECT and 4 KiB sectors, described by a generated sysfs tree in the kernel's
native-multipath layout, so the real resolution, health and raw block paths run.

    with LoopNamespaces(tmpdir, count=2, size=256 << 20) as fake:
        config = {"tiers": {"nvmeof": fake.tier_config(capacity="200MiB")}}
        fake.set_state(0, "connecting")     # controller of namespace 0 loses its path

The sysfs tree is also what `write_sysfs` builds for tests without loop devices.
`small_filesystem` mounts a small ext4 filesystem on a loop device: a disk that fills up.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

SUBNQN = "nqn.2026-12.io.kvstore:loop-standin"


@dataclass
class FakeNamespace:
    block_name: str  # a name under dev_root: "loop3", or "nvme0n1" in sysfs-only tests
    nsid: int
    controller: str  # the controller directory name, e.g. "nvme0"
    uuid: str = field(default_factory=lambda: str(uuid.uuid4()))
    logical_block_size: int = 4096


def write_sysfs(root: str, namespaces: list[FakeNamespace], subnqn: str = SUBNQN,
                traddr: str = "192.0.2.10", state: str = "live", subsystem_index: int = 0) -> None:
    """Adds one subsystem to a sysfs tree, with one controller per distinct `controller`
    name (several controllers of one subsystem are several paths to its namespaces)."""
    subsystem = os.path.join(root, "class", "nvme-subsystem", f"nvme-subsys{subsystem_index}")
    os.makedirs(subsystem, exist_ok=True)
    _write(os.path.join(subsystem, "subsysnqn"), subnqn)
    for name in sorted({ns.controller for ns in namespaces}):
        controller = os.path.join(root, "class", "nvme", name)
        os.makedirs(controller, exist_ok=True)
        for attr, value in (("state", state), ("transport", "tcp"), ("subsysnqn", subnqn),
                            ("address", f"traddr={traddr},trsvcid=4420,src_addr=192.0.2.1")):
            _write(os.path.join(controller, attr), value)
        link = os.path.join(subsystem, name)
        if not os.path.lexists(link):
            os.symlink(os.path.relpath(controller, subsystem), link)
    for ns in namespaces:
        directory = os.path.join(subsystem, ns.block_name)
        os.makedirs(os.path.join(directory, "queue"), exist_ok=True)
        _write(os.path.join(directory, "nsid"), str(ns.nsid))
        _write(os.path.join(directory, "uuid"), ns.uuid)
        _write(os.path.join(directory, "queue", "logical_block_size"), str(ns.logical_block_size))
    os.makedirs(os.path.join(root, "module", "nvme_tcp"), exist_ok=True)


def set_controller_state(root: str, controller: str, state: str) -> None:
    _write(os.path.join(root, "class", "nvme", controller, "state"), state)


def _write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text + "\n")


def loop_devices_unavailable() -> str | None:
    """Why loop devices cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to attach loop devices"
    if shutil.which("losetup") is None:
        return "losetup not installed"
    return None


def filesystem_unavailable() -> str | None:
    """Why a loop-mounted filesystem cannot be made here, or None when it can."""
    missing = [tool for tool in ("mount", "umount", "mkfs.ext4") if shutil.which(tool) is None]
    return loop_devices_unavailable() or (f"{', '.join(missing)} not installed" if missing else None)


@contextmanager
def small_filesystem(workdir: str, size: int) -> Iterator[str]:
    """An empty ext4 filesystem of `size` bytes (a sparse file in `workdir` on a loop
    device), mounted at a directory it yields; unmounted and removed after."""
    image, mountpoint = os.path.join(workdir, "small-fs.img"), os.path.join(workdir, "small-fs")
    with open(image, "wb") as handle:
        handle.truncate(size)
    os.makedirs(mountpoint, exist_ok=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", image], check=True, capture_output=True, timeout=60)
    subprocess.run(["mount", "-o", "loop", image, mountpoint], check=True, capture_output=True, timeout=60)
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", mountpoint], check=False, capture_output=True, timeout=60)
        os.unlink(image)


class LoopDevices:
    """`count` loop devices of `size` bytes each (sparse files in `workdir`, direct I/O,
    4 KiB sectors, like an NVMe namespace); detached on exit."""

    def __init__(self, workdir: str, count: int, size: int) -> None:
        self.workdir = workdir
        self.count, self.size = count, size
        self.devices: list[str] = []

    def __enter__(self) -> LoopDevices:
        try:
            for i in range(self.count):
                backing = os.path.join(self.workdir, f"namespace{i}.img")
                with open(backing, "wb") as handle:
                    handle.truncate(self.size)
                self.devices.append(subprocess.run(
                    ["losetup", "--find", "--show", "--direct-io=on", "--sector-size", "4096", backing],
                    check=True, capture_output=True, text=True, timeout=30).stdout.strip())
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for device in self.devices:
            subprocess.run(["losetup", "--detach", device], check=False, capture_output=True, timeout=30)
        self.devices.clear()


class LoopNamespaces(LoopDevices):
    """Loop devices under a generated sysfs tree, one NVMe-oF subsystem each."""

    def __init__(self, workdir: str, count: int, size: int) -> None:
        super().__init__(workdir, count, size)
        self.sysfs_root = os.path.join(workdir, "sysfs")
        self.namespaces: list[FakeNamespace] = []

    def __enter__(self) -> LoopNamespaces:
        super().__enter__()
        for i, device in enumerate(self.devices):  # one subsystem each: a path loss hits one
            self.namespaces.append(FakeNamespace(os.path.basename(device), nsid=1, controller=f"nvme{i}"))
            write_sysfs(self.sysfs_root, [self.namespaces[-1]], self.subnqn(i), subsystem_index=i)
        return self

    @staticmethod
    def subnqn(index: int) -> str:
        return f"{SUBNQN}-{index}"

    def tier_config(self, capacity: str | int, count: int | None = None) -> dict[str, Any]:
        """A `tiers.nvmeof` block naming the first `count` namespaces (all by default)."""
        return {"transport": "tcp", "traddr": "192.0.2.10", "sysfs_root": self.sysfs_root,
                "health_interval_s": 0.2,
                "namespaces": [{"subnqn": self.subnqn(i), "nsid": ns.nsid, "capacity": capacity}
                               for i, ns in enumerate(self.namespaces[: count or self.count])]}

    def set_state(self, index: int, state: str) -> None:
        set_controller_state(self.sysfs_root, self.namespaces[index].controller, state)
