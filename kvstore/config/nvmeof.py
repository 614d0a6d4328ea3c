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

Every connection field may sit at the tier level (shared) or on a namespace; an error
about a shared one names it at the tier level (`tiers.nvmeof.traddr`).
"""

from __future__ import annotations

import ipaddress
import uuid as uuid_module
from typing import Annotated, Any

from pydantic import Field, model_validator

from kvstore.config.schema import Kind, Refused, Schema, Text, choice, integer, seconds, size, validate

_MAX_NQN = 223  # NVMe base spec: an NQN is at most 223 bytes


def _ip_address(value: Any) -> str:
    try:
        ipaddress.ip_address(value if isinstance(value, str) else "")
    except ValueError:
        raise ValueError("must be an IP address (the kernel's initiator needs one, "
                         "not a host name)") from None
    return value


def _nqn(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("nqn.") or len(value.encode()) > _MAX_NQN:
        raise ValueError(f"must be an NVMe qualified name: 'nqn.' and at most {_MAX_NQN} bytes")
    return value


def _uuid(value: Any) -> str:
    try:
        return str(uuid_module.UUID(value if isinstance(value, str) else ""))
    except ValueError:
        raise ValueError("must be a namespace UUID like 1b4e28ba-2fa1-11d2-883f-0016d3cca427") from None


IpAddress = Annotated[str, Kind("IP address", _ip_address, lambda value: f"`{value}`")]
Nqn = Annotated[str, Kind("NQN", _nqn, lambda value: f"`{value}`")]


class _Connection(Schema):
    """What `nvme connect` needs: given at the tier level, on a namespace, or both."""

    transport: Annotated[str, choice("tcp", "rdma")] = Field(
        "tcp", description="the fabric transport (kernel module `nvme-tcp` or `nvme-rdma`)")
    traddr: IpAddress = Field(description="the array's address; an IP address, as the kernel needs one")
    trsvcid: Annotated[int, integer(1, 65535)] = Field(4420, description="the array's port")
    subnqn: Nqn = Field(description="the subsystem's NQN (`nqn.` and at most 223 bytes)")
    hostnqn: Nqn | None = Field(
        None, description="this host's NQN, passed to `nvme connect`; none: `/etc/nvme/hostnqn`")
    nr_io_queues: Annotated[int, integer(1, 1024)] | None = Field(
        None, description="I/O queues to open; none: the kernel's choice")
    queue_size: Annotated[int, integer(16, 65536)] | None = Field(
        None, description="entries per I/O queue; none: the kernel's choice")
    ctrl_loss_tmo: Annotated[int, integer(-1, 1 << 20)] | None = Field(
        None, description="seconds the kernel keeps reconnecting a lost controller before it "
                          "deletes it; -1: forever; none: the kernel's default (600)")
    reconnect_delay: Annotated[int, integer(1, 1 << 20)] | None = Field(
        None, description="seconds between reconnect attempts (at most `ctrl_loss_tmo`); "
                          "none: the kernel's default (10)")
    fast_io_fail_tmo: Annotated[int, integer(-1, 1 << 20)] | None = Field(
        5, description="seconds into a path loss after which queued I/O fails (a miss) instead "
                       "of waiting (at most `ctrl_loss_tmo`); -1: off; null: the kernel's default (off)")


_SHARED_KEYS = frozenset(_Connection.model_fields)


class NamespaceConfig(_Connection):
    """One remote namespace: how to reach its subsystem, which namespace, how much to use."""

    nsid: Annotated[int, integer(1, 0xFFFFFFFE)] | None = Field(
        None, description="which namespace of the subsystem, by NSID; give this or `uuid`")
    uuid: Annotated[str, Kind("UUID", _uuid)] | None = Field(
        None, description="which namespace, by its UUID; give this or `nsid`")
    capacity: Annotated[int, size(1 << 20)] = Field(
        description="bytes kvstore may use on that namespace, metadata included")

    @model_validator(mode="after")
    def _consistent(self) -> NamespaceConfig:
        if (self.nsid is None) == (self.uuid is None):
            raise Refused("give exactly one of nsid or uuid", "nsid", value=self.nsid)
        loss = self.ctrl_loss_tmo
        if loss is not None and loss >= 0:
            if self.fast_io_fail_tmo is not None and self.fast_io_fail_tmo > loss:
                raise Refused(f"must not exceed ctrl_loss_tmo ({loss}): the kernel refuses it",
                              "fast_io_fail_tmo", value=self.fast_io_fail_tmo)
            if self.reconnect_delay is not None and self.reconnect_delay > loss:
                raise Refused(f"must not exceed ctrl_loss_tmo ({loss})", "reconnect_delay",
                              value=self.reconnect_delay)
        return self

    @property
    def label(self) -> str:
        """How logs and errors name it: subsystem and namespace, never a device name."""
        which = f"nsid {self.nsid}" if self.nsid is not None else f"uuid {self.uuid}"
        return f"{self.subnqn} {which}"

    @property
    def connection(self) -> tuple[str, str, int, str, str | None]:
        """What one `nvme connect` establishes; namespaces sharing it share a controller."""
        return (self.transport, self.traddr, self.trsvcid, self.subnqn, self.hostnqn)


class NvmeofConfig(Schema):
    """NVMe-over-Fabrics namespaces striped as one block tier (with any `disk` paths)."""

    namespaces: tuple[NamespaceConfig, ...] = Field(
        min_length=1, description="the namespaces to stripe over, in this order")
    sysfs_root: Text = Field("/sys", description="where sysfs is mounted (containers, tests)")
    dev_root: Text = Field("/dev", description="where the block devices are (containers, tests)")
    health_interval_s: Annotated[float, seconds()] = Field(
        1.0, description="how often controller states are read")

    @classmethod
    def written_keys(cls) -> set[str]:
        return super().written_keys() | _SHARED_KEYS

    @classmethod
    def reshape(cls, data: Any) -> Any:
        """A bare list is the namespaces; shared connection keys go to every namespace
        that does not set its own."""
        if isinstance(data, list):
            return {"namespaces": data}
        if not isinstance(data, dict):
            return data
        shared = {key: value for key, value in data.items() if key in _SHARED_KEYS}
        tier = {key: value for key, value in data.items() if key not in _SHARED_KEYS}
        if isinstance(tier.get("namespaces"), list):
            tier["namespaces"] = [{**shared, **entry} if isinstance(entry, dict) else entry
                                  for entry in tier["namespaces"]]
        return tier

    @model_validator(mode="after")
    def _distinct(self) -> NvmeofConfig:
        seen: dict[tuple[str, int | None, str | None], int] = {}
        for i, ns in enumerate(self.namespaces):
            identity = (ns.subnqn, ns.nsid, ns.uuid)
            if identity in seen:
                raise Refused(f"the same namespace as namespaces[{seen[identity]}]", "namespaces", i,
                              value=ns.label)
            seen[identity] = i
        return self


def parse_nvmeof(value: Any) -> NvmeofConfig:
    """Validate `tiers.nvmeof` (a mapping with `namespaces`, or a bare list of namespaces)."""
    return validate(NvmeofConfig, value, "tiers.nvmeof")


def dump_nvmeof(config: NvmeofConfig) -> dict[str, Any]:
    """The schema form (each namespace with all its connection fields), read back by parse_nvmeof."""
    return config.model_dump(mode="json")
