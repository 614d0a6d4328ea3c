"""Turn `tiers.nvmeof` into disk-tier devices: resolve each namespace now, probe it later.

A namespace that is not connected or not live at start-up does not stop the service:
it starts without it (a logged warning naming it) and the health monitor opens it once
it is live. Only a namespace that can never work (a logical block size that does not
divide 4096) is an error.
"""

from __future__ import annotations

import functools
import logging

from kvstore.config.nvmeof import NamespaceConfig, NvmeofConfig
from kvstore.devices.device import DevicePlan
from kvstore.devices.health import Presence
from kvstore.devices.nvmeof.sysfs import Resolved, resolve
from kvstore.format.errors import DeviceError

log = logging.getLogger(__name__)


def namespace_plans(config: NvmeofConfig) -> list[DevicePlan]:
    """One DevicePlan per namespace, with `path` None for one not usable now."""
    plans = []
    for ns in config.namespaces:
        found = resolve(ns, config.sysfs_root, config.dev_root)
        if found is not None and found.logical_block_size and 4096 % found.logical_block_size:
            raise DeviceError(ns.label, f"logical block size {found.logical_block_size} does not "
                                        "divide 4096")
        presence = _presence(found, config)
        if not presence.usable:
            log.warning("nvmeof: %s: %s; starting without it, it is added once connected and live "
                        "(kvstore nvmeof connect --config ...)", ns.label, presence.why)
        plans.append(DevicePlan(presence.path if presence.usable else None, ns.capacity, kind="nvmeof",
                                label=ns.label, probe=functools.partial(_probe, ns, config)))
    return plans


def _probe(ns: NamespaceConfig, config: NvmeofConfig) -> Presence:
    return _presence(_find(ns, config), config)


def _find(ns: NamespaceConfig, config: NvmeofConfig) -> Resolved | None:
    return resolve(ns, config.sysfs_root, config.dev_root)


def _presence(found: Resolved | None, config: NvmeofConfig) -> Presence:
    if found is None:
        return Presence(False, f"no such namespace under {config.sysfs_root} (not connected, or "
                               "its controller was deleted when ctrl_loss_tmo expired)")
    if not found.live:
        return Presence(False, f"controller state {found.state}", found.device)
    return Presence(True, "", found.device)
