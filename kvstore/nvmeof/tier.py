"""Turn `tiers.nvmeof` into disk-tier devices: resolve each namespace now, probe it later."""

from __future__ import annotations

from kvstore.devices import DevicePlan
from kvstore.errors import DeviceError
from kvstore.nvmeof.config import NamespaceConfig, NvmeofConfig
from kvstore.nvmeof.sysfs import resolve


def namespace_plans(config: NvmeofConfig) -> list[DevicePlan]:
    """One DevicePlan per namespace; a namespace this host cannot use now is an error
    that names it (start-up is when an operator is watching)."""
    plans = []
    for ns in config.namespaces:
        found = resolve(ns, config.sysfs_root, config.dev_root)
        if found is None:
            raise DeviceError(ns.label, f"no such namespace under {config.sysfs_root}; connect it "
                                        "first (kvstore nvmeof connect --config ...)")
        if not found.live:
            raise DeviceError(ns.label, f"found as {found.device} but no controller is live "
                                        f"({found.state})")
        if found.logical_block_size and 4096 % found.logical_block_size:
            raise DeviceError(ns.label, f"logical block size {found.logical_block_size} does not "
                                        "divide 4096")
        plans.append(DevicePlan(found.device, ns.capacity, kind="nvmeof",
                                label=f"{ns.label} ({found.device})",
                                probe=_probe(ns, config, found.block_name)))
    return plans


def _probe(ns: NamespaceConfig, config: NvmeofConfig, block_name: str):  # -> Probe
    def probe() -> tuple[bool, str]:
        found = resolve(ns, config.sysfs_root, config.dev_root)
        if found is None:
            return False, "namespace gone from sysfs (disconnected, or ctrl_loss_tmo expired)"
        if found.block_name != block_name:
            return False, (f"namespace reappeared as {found.device}; restart kvstore to use the "
                           "new device")
        if not found.live:
            return False, f"controller state {found.state}"
        return True, ""

    return probe
