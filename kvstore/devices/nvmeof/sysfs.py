"""Find a namespace's block device and its controllers' states through sysfs.

A namespace is found by subsystem NQN and NSID (or UUID), never by its device name:
`nvme0n1` can become `nvme2n1` after a reboot or a reconnect. Two layouts exist:
- native multipath: /sys/class/nvme-subsystem/nvme-subsysN/{subsysnqn, <namespace>/, <controller>}
- without it:       /sys/class/nvme/nvmeN/{subsysnqn, state, <namespace>/}
A directory with an `nsid` file is a namespace, one with a `state` file a controller;
names are not trusted (hidden per-path devices `nvmeXcYnZ` are skipped: no /dev node).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from kvstore.config.nvmeof import NamespaceConfig

LIVE = "live"
_HIDDEN_PATH_DEVICE = re.compile(r"^nvme\d+c\d+n\d+$")


@dataclass(frozen=True)
class Controller:
    name: str
    state: str  # live, connecting, resetting, deleting, dead, ...
    transport: str
    address: str  # e.g. "traddr=10.0.0.5,trsvcid=4420"


@dataclass(frozen=True)
class Resolved:
    """Where a configured namespace is on this host right now."""

    label: str
    block_name: str
    device: str  # the /dev node
    logical_block_size: int | None
    controllers: tuple[Controller, ...] = field(default_factory=tuple)

    @property
    def live(self) -> bool:
        """Usable: at least one controller (path) to its subsystem is live."""
        return any(c.state == LIVE for c in self.controllers)

    @property
    def state(self) -> str:
        if self.live:
            return LIVE
        return ",".join(sorted({c.state for c in self.controllers})) or "no controller"


def _read(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return None


def _children(directory: str) -> list[str]:
    try:
        return sorted(os.path.join(directory, name) for name in os.listdir(directory))
    except OSError:
        return []


def _controller(path: str) -> Controller:
    return Controller(name=os.path.basename(path), state=_read(os.path.join(path, "state")) or "unknown",
                      transport=_read(os.path.join(path, "transport")) or "",
                      address=_read(os.path.join(path, "address")) or "")


def _subsystem_members(subnqn: str, sysfs_root: str) -> tuple[list[str], list[str]]:
    """(namespace dirs, controller dirs) of the subsystem with this NQN, both layouts."""
    namespaces: list[str] = []
    controllers: list[str] = []
    parents = [d for d in _children(os.path.join(sysfs_root, "class", "nvme-subsystem"))
               if _read(os.path.join(d, "subsysnqn")) == subnqn]
    parents += [d for d in _children(os.path.join(sysfs_root, "class", "nvme"))
                if _read(os.path.join(d, "subsysnqn")) == subnqn]
    for parent in parents:
        if os.path.exists(os.path.join(parent, "state")):
            controllers.append(parent)
        for child in _children(parent):
            if os.path.exists(os.path.join(child, "nsid")):
                if not _HIDDEN_PATH_DEVICE.match(os.path.basename(child)):
                    namespaces.append(child)
            elif os.path.exists(os.path.join(child, "state")):
                controllers.append(child)
    return namespaces, controllers


def _matches(namespace_dir: str, ns: NamespaceConfig) -> bool:
    if ns.nsid is not None:
        return _read(os.path.join(namespace_dir, "nsid")) == str(ns.nsid)
    return (_read(os.path.join(namespace_dir, "uuid")) or "").lower() == (ns.uuid or "").lower()


def resolve(ns: NamespaceConfig, sysfs_root: str = "/sys", dev_root: str = "/dev") -> Resolved | None:
    """The namespace's device and controllers, or None when this host does not see it."""
    namespaces, controllers = _subsystem_members(ns.subnqn, sysfs_root)
    found = [d for d in namespaces if _matches(d, ns)]
    if not found:
        return None
    directory = found[0]
    name = os.path.basename(directory)
    block = (_read(os.path.join(directory, "queue", "logical_block_size"))
             or _read(os.path.join(sysfs_root, "block", name, "queue", "logical_block_size")))
    unique = {os.path.basename(c): c for c in controllers}
    return Resolved(label=ns.label, block_name=name, device=os.path.join(dev_root, name),
                    logical_block_size=int(block) if block and block.isdigit() else None,
                    controllers=tuple(_controller(unique[n]) for n in sorted(unique)))


def fabrics_available(transport: str, sysfs_root: str = "/sys") -> tuple[bool, str]:
    """Whether the kernel can make fabric connections of this transport, and if not why."""
    module = f"nvme_{transport}"
    if os.path.isdir(os.path.join(sysfs_root, "module", module)):
        return True, ""
    return False, (f"kernel module {module} is not loaded (try: modprobe nvme-{transport}); "
                   "this kernel may lack NVMe-oF support")
