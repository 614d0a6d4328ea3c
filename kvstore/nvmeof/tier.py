"""Turn `tiers.nvmeof` into disk-tier devices: resolve each namespace now, probe it later.

A namespace that is not connected or not live at start-up does not stop the service:
it starts without it (a logged warning naming it) and the health monitor opens it once
it is live. Only a namespace that can never work (a logical block size that does not
divide 4096) is an error.
"""

from __future__ import annotations

import logging

from kvstore.devices import DevicePlan
from kvstore.errors import DeviceError
from kvstore.nvmeof.config import NamespaceConfig, NvmeofConfig
from kvstore.nvmeof.sysfs import Resolved, resolve

log = logging.getLogger(__name__)


def namespace_plans(config: NvmeofConfig) -> list[DevicePlan]:
    """One DevicePlan per namespace, with `path` None for one not usable now."""
    plans = []
    for ns in config.namespaces:
        found = resolve(ns, config.sysfs_root, config.dev_root)
        if found is not None and found.logical_block_size and 4096 % found.logical_block_size:
            raise DeviceError(ns.label, f"logical block size {found.logical_block_size} does not "
                                        "divide 4096")
        usable, why = _usable(found, config)
        if not usable:
            log.warning("nvmeof: %s: %s; starting without it, it is added once connected and live "
                        "(kvstore nvmeof connect --config ...)", ns.label, why)
        plans.append(DevicePlan(found.device if usable and found else None, ns.capacity, kind="nvmeof",
                                label=ns.label, probe=lambda ns=ns: _usable(_find(ns, config), config),
                                locate=lambda ns=ns: _device(_find(ns, config))))
    return plans


def _find(ns: NamespaceConfig, config: NvmeofConfig) -> Resolved | None:
    return resolve(ns, config.sysfs_root, config.dev_root)


def _device(found: Resolved | None) -> str | None:
    return found.device if found is not None else None


def _usable(found: Resolved | None, config: NvmeofConfig) -> tuple[bool, str]:
    if found is None:
        return False, (f"no such namespace under {config.sysfs_root} (not connected, or its "
                       "controller was deleted when ctrl_loss_tmo expired)")
    if not found.live:
        return False, f"controller state {found.state}"
    return True, ""
