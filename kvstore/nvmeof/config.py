"""The `tiers.nvmeof` config: shared connection fields plus namespaces to stripe over.

    tiers:
      nvmeof:
        transport: tcp            # tcp | rdma
        traddr: 10.0.0.5
        trsvcid: 4420
        subnqn: nqn.2026-01.io.example:kv
        fast_io_fail_tmo: 5       # fail I/O 5 s into a path loss (kernel default: never)
        namespaces:
          - {nsid: 1, capacity: 1TiB}
          - {nsid: 2, capacity: 1TiB, traddr: 10.0.0.6}   # any field may be overridden

Every connection field may sit at the tier level (shared) or on a namespace.
"""

from __future__ import annotations

import ipaddress
import uuid
from dataclasses import dataclass
from typing import Any

from kvstore.errors import ConfigError
from kvstore.fields import (
    check_keys,
    choice_field,
    int_field,
    mapping_field,
    seconds_field,
    size_field,
    text_field,
)

TRANSPORTS = ("tcp", "rdma")
DEFAULT_FAST_IO_FAIL_TMO = 5
_CONNECTION_KEYS = {"transport", "traddr", "trsvcid", "subnqn", "hostnqn", "nr_io_queues",
                    "queue_size", "ctrl_loss_tmo", "reconnect_delay", "fast_io_fail_tmo"}
_NAMESPACE_KEYS = _CONNECTION_KEYS | {"nsid", "uuid", "capacity"}
_TIER_KEYS = _CONNECTION_KEYS | {"namespaces", "sysfs_root", "dev_root", "health_interval_s"}
_MAX_NQN = 223  # NVMe base spec: an NQN is at most 223 bytes


@dataclass(frozen=True)
class NamespaceConfig:
    """One remote namespace: how to reach its subsystem, which namespace, how much to use."""

    transport: str
    traddr: str
    subnqn: str
    capacity: int
    trsvcid: int = 4420
    nsid: int | None = None
    uuid: str | None = None
    hostnqn: str | None = None
    nr_io_queues: int | None = None
    queue_size: int | None = None
    ctrl_loss_tmo: int | None = None  # -1: reconnect forever
    reconnect_delay: int | None = None
    fast_io_fail_tmo: int | None = DEFAULT_FAST_IO_FAIL_TMO  # -1: off

    @property
    def label(self) -> str:
        """How logs and errors name it: subsystem and namespace, never a device name."""
        which = f"nsid {self.nsid}" if self.nsid is not None else f"uuid {self.uuid}"
        return f"{self.subnqn} {which}"

    @property
    def connection(self) -> tuple[str, str, int, str, str | None]:
        """What one `nvme connect` establishes; namespaces sharing it share a controller."""
        return (self.transport, self.traddr, self.trsvcid, self.subnqn, self.hostnqn)


@dataclass(frozen=True)
class NvmeofConfig:
    namespaces: tuple[NamespaceConfig, ...]
    sysfs_root: str = "/sys"  # another tree for containers and tests
    dev_root: str = "/dev"
    health_interval_s: float = 1.0  # how often controller states are read


def parse_nvmeof(value: Any) -> NvmeofConfig:
    """Validate `tiers.nvmeof` (a mapping with `namespaces`, or a bare list of namespaces)."""
    tier = {"namespaces": value} if isinstance(value, list) else mapping_field("tiers.nvmeof", value)
    check_keys("tiers.nvmeof", tier, _TIER_KEYS)
    entries = tier.get("namespaces")
    if not isinstance(entries, list) or not entries:
        raise ConfigError("tiers.nvmeof.namespaces", entries, "required: a non-empty list of namespaces")
    shared = {k: v for k, v in tier.items() if k in _CONNECTION_KEYS}
    namespaces = []
    for i, entry in enumerate(entries):
        where = f"tiers.nvmeof.namespaces[{i}]"
        entry = mapping_field(where, entry)
        check_keys(where, entry, _NAMESPACE_KEYS)
        namespaces.append(_parse_namespace(where, {**shared, **entry},
                                           {k: "tiers.nvmeof" for k in shared if k not in entry}))
    seen: dict[tuple[str, int | None, str | None], int] = {}
    for i, ns in enumerate(namespaces):
        identity = (ns.subnqn, ns.nsid, ns.uuid)
        if identity in seen:
            raise ConfigError(f"tiers.nvmeof.namespaces[{i}]", ns.label,
                              f"the same namespace as namespaces[{seen[identity]}]")
        seen[identity] = i
    return NvmeofConfig(
        namespaces=tuple(namespaces),
        sysfs_root=text_field("tiers.nvmeof.sysfs_root", tier.get("sysfs_root", "/sys")),
        dev_root=text_field("tiers.nvmeof.dev_root", tier.get("dev_root", "/dev")),
        health_interval_s=seconds_field("tiers.nvmeof.health_interval_s",
                                        tier.get("health_interval_s", 1.0)),
    )


def _parse_namespace(where: str, fields: dict[str, Any], inherited: dict[str, str]) -> NamespaceConfig:
    def name(key: str) -> str:
        return f"{inherited.get(key, where)}.{key}"

    transport = choice_field(name("transport"), fields.get("transport", "tcp"), TRANSPORTS)
    traddr = text_field(name("traddr"), fields.get("traddr"))
    try:
        ipaddress.ip_address(traddr)
    except ValueError:
        raise ConfigError(name("traddr"), traddr, f"must be an IP address ({transport} needs one, "
                                                  "not a host name)") from None
    subnqn = _nqn(name("subnqn"), fields.get("subnqn"))
    hostnqn = _nqn(name("hostnqn"), fields["hostnqn"]) if fields.get("hostnqn") is not None else None
    if ("nsid" in fields) == ("uuid" in fields):
        raise ConfigError(f"{where}.nsid", fields.get("nsid"), "give exactly one of nsid or uuid")
    nsid = int_field(f"{where}.nsid", fields["nsid"], 1, 0xFFFFFFFE) if "nsid" in fields else None
    ns_uuid = _uuid(f"{where}.uuid", fields["uuid"]) if "uuid" in fields else None
    if "capacity" not in fields:
        raise ConfigError(f"{where}.capacity", None, "required")

    def optional(key: str, minimum: int, maximum: int, default: int | None = None) -> int | None:
        value = fields.get(key, default)
        return None if value is None else int_field(name(key), value, minimum, maximum)

    ctrl_loss = optional("ctrl_loss_tmo", -1, 1 << 20)
    fast_fail = optional("fast_io_fail_tmo", -1, 1 << 20, DEFAULT_FAST_IO_FAIL_TMO)
    delay = optional("reconnect_delay", 1, 1 << 20)
    if ctrl_loss is not None and ctrl_loss >= 0:
        if fast_fail is not None and fast_fail > ctrl_loss:
            raise ConfigError(name("fast_io_fail_tmo"), fast_fail,
                              f"must not exceed ctrl_loss_tmo ({ctrl_loss}): the kernel refuses it")
        if delay is not None and delay > ctrl_loss:
            raise ConfigError(name("reconnect_delay"), delay,
                              f"must not exceed ctrl_loss_tmo ({ctrl_loss})")
    return NamespaceConfig(
        transport=transport, traddr=traddr, subnqn=subnqn,
        capacity=size_field(f"{where}.capacity", fields["capacity"], minimum=1 << 20),
        trsvcid=int_field(name("trsvcid"), fields.get("trsvcid", 4420), 1, 65535),
        nsid=nsid, uuid=ns_uuid, hostnqn=hostnqn,
        nr_io_queues=optional("nr_io_queues", 1, 1024),
        queue_size=optional("queue_size", 16, 65536),
        ctrl_loss_tmo=ctrl_loss, reconnect_delay=delay, fast_io_fail_tmo=fast_fail,
    )


def _nqn(where: str, value: Any) -> str:
    text = text_field(where, value)
    if not text.startswith("nqn.") or len(text.encode()) > _MAX_NQN:
        raise ConfigError(where, value, f"must be an NVMe qualified name: 'nqn.' and at most "
                                        f"{_MAX_NQN} bytes")
    return text


def _uuid(where: str, value: Any) -> str:
    try:
        return str(uuid.UUID(str(value)))
    except ValueError:
        raise ConfigError(where, value, "must be a namespace UUID like "
                                        "1b4e28ba-2fa1-11d2-883f-0016d3cca427") from None


def dump_nvmeof(config: NvmeofConfig) -> dict[str, Any]:
    """The schema form, read back by parse_nvmeof."""
    namespaces = []
    for ns in config.namespaces:
        entry = {k: getattr(ns, k) for k in sorted(_NAMESPACE_KEYS) if getattr(ns, k) is not None}
        if ns.fast_io_fail_tmo is None:
            entry["fast_io_fail_tmo"] = None
        namespaces.append(entry)
    return {"namespaces": namespaces, "sysfs_root": config.sysfs_root, "dev_root": config.dev_root,
            "health_interval_s": config.health_interval_s}
