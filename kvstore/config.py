"""The one configuration schema (YAML file, JSON text or dict), validated on load.

Every error is a ConfigError that names the dotted field and the bad value, because
a config is usually written by hand and read by a service that fails at start-up.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvstore.errors import ConfigError
from kvstore.fields import check_keys, choice_field, int_field, mapping_field, seconds_field, size_field
from kvstore.nvmeof.config import NvmeofConfig, dump_nvmeof, parse_nvmeof

IO_ENGINES = ("auto", "uring", "threads")
WRITE_POLICIES = ("write_back", "write_through")


@dataclass(frozen=True)
class HostTierConfig:
    """DRAM tier. `shm_name` puts the slab in /dev/shm so other processes can map it."""

    capacity: int
    shm_name: str | None = None


@dataclass(frozen=True)
class DiskPathConfig:
    """One disk path: a directory (a preallocated file inside) or a raw block device."""

    path: str
    capacity: int


@dataclass(frozen=True)
class IoConfig:
    engine: str = "auto"
    queue_depth: int = 64
    timeout_s: float = 30.0  # deadline of one batch of tier I/O; past it the chunks are misses
    # A device whose I/O faults this many times in a row is taken out of service (its
    # chunks become misses) and probed again after the cooldown.
    breaker_threshold: int = 3
    breaker_cooldown_s: float = 5.0


@dataclass(frozen=True)
class ServiceConfig:
    """The per-host service (`kvstore serve`) that engine plugins talk to.

    `socket` is where it listens; `spawn` lets a client start it on demand;
    `staging` is the shared-memory window each client moves chunks through.
    """

    socket: str = field(default_factory=lambda: f"/tmp/kvstore-{os.getuid()}.sock")
    spawn: bool = True
    staging: int = 256 << 20
    metrics_port: int = 0  # Prometheus /metrics on this TCP port; 0: off


@dataclass(frozen=True)
class StoreConfig:
    chunk_tokens: int = 256
    host: HostTierConfig | None = None
    disk: tuple[DiskPathConfig, ...] = ()
    nvmeof: NvmeofConfig | None = None
    io: IoConfig = field(default_factory=IoConfig)
    # Bound on DRAM->disk demotions waiting to be written; past it a demotion is
    # dropped (counted) so that a put never waits on the disk.
    write_behind_chunks: int = 64
    promote_on_hit: bool = True
    # Bound on the bytes one prefetch reads at a time (a prefetch goes in waves of this).
    prefetch_inflight: int = 256 << 20
    # write_back: a chunk reaches disk when DRAM evicts it (or at shutdown);
    # write_through: also as soon as it is stored, so a killed service loses nothing.
    write_policy: str = "write_back"
    disk_min_seen: int = 1  # admission: a chunk goes to disk once stored or read this often
    service: ServiceConfig = field(default_factory=ServiceConfig)


def load_config(source: StoreConfig | dict[str, Any] | str | os.PathLike[str]) -> StoreConfig:
    """Accept a StoreConfig, a dict, JSON/YAML text, or a path to a .yaml/.json file."""
    if isinstance(source, StoreConfig):
        return source
    if isinstance(source, dict):
        return _parse_root(source)
    text = str(source)
    path = Path(text)
    if _names_a_file(text, path):
        if not path.is_file():
            raise ConfigError("config", text, "file not found")
        text = path.read_text()
    try:
        data = json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError("config", str(source)[:80], f"not valid YAML/JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError("config", data, "must be a mapping")
    return _parse_root(data)


def _names_a_file(text: str, path: Path) -> bool:
    """A one-line source that is not inline JSON/YAML names a file. (Inline JSON can be
    longer than a path may be: asking the file system about it would fail.)"""
    if "\n" in text or text.lstrip().startswith("{"):
        return False
    try:
        return path.suffix in (".yaml", ".yml", ".json") or path.exists()
    except OSError:
        return False


def _parse_root(data: dict[str, Any]) -> StoreConfig:
    check_keys("", data, {"chunk_tokens", "tiers", "io", "write_behind_chunks", "promote_on_hit",
                          "prefetch_inflight", "write_policy", "disk_min_seen", "service"})
    tiers = mapping_field("tiers", data.get("tiers", {}))
    check_keys("tiers", tiers, {"host", "disk", "nvmeof"})
    host = _parse_host(tiers["host"]) if tiers.get("host") is not None else None
    disk = _parse_disks(tiers.get("disk") or [])
    nvmeof = parse_nvmeof(tiers["nvmeof"]) if tiers.get("nvmeof") is not None else None
    if host is None and not disk and nvmeof is None:
        raise ConfigError("tiers", tiers, "configure at least one tier (host, disk or nvmeof)")
    promote = data.get("promote_on_hit", True)
    if not isinstance(promote, bool):
        raise ConfigError("promote_on_hit", promote, "must be true or false")
    return StoreConfig(
        chunk_tokens=int_field("chunk_tokens", data.get("chunk_tokens", 256), 1, 1 << 20),
        host=host,
        disk=disk,
        nvmeof=nvmeof,
        io=_parse_io(mapping_field("io", data.get("io", {}))),
        write_behind_chunks=int_field("write_behind_chunks", data.get("write_behind_chunks", 64), 0, 1 << 20),
        promote_on_hit=promote,
        prefetch_inflight=size_field("prefetch_inflight", data.get("prefetch_inflight", 256 << 20)),
        write_policy=choice_field("write_policy", data.get("write_policy", "write_back"), WRITE_POLICIES),
        disk_min_seen=int_field("disk_min_seen", data.get("disk_min_seen", 1), 1, 1 << 20),
        service=_parse_service(mapping_field("service", data.get("service", {}))),
    )


def _parse_host(value: Any) -> HostTierConfig:
    host = mapping_field("tiers.host", value)
    check_keys("tiers.host", host, {"capacity", "shm_name"})
    if "capacity" not in host:
        raise ConfigError("tiers.host.capacity", None, "required")
    shm_name = host.get("shm_name")
    if shm_name is not None and (not isinstance(shm_name, str) or "/" in shm_name or not shm_name):
        raise ConfigError("tiers.host.shm_name", shm_name, "must be a plain file name under /dev/shm")
    return HostTierConfig(capacity=size_field("tiers.host.capacity", host["capacity"]), shm_name=shm_name)


def _parse_disks(value: Any) -> tuple[DiskPathConfig, ...]:
    entries = [value] if isinstance(value, dict) else value
    if not isinstance(entries, list):
        raise ConfigError("tiers.disk", value, "must be a list of {path, capacity}")
    disks = []
    for i, entry in enumerate(entries):
        where = f"tiers.disk[{i}]"
        entry = mapping_field(where, entry)
        check_keys(where, entry, {"path", "capacity"})
        path = entry.get("path")
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{where}.path", path, "required: a directory or a block device")
        if "capacity" not in entry:
            raise ConfigError(f"{where}.capacity", None, "required")
        disks.append(DiskPathConfig(path=path, capacity=size_field(f"{where}.capacity", entry["capacity"])))
    paths = [os.path.realpath(d.path) for d in disks]
    if len(set(paths)) != len(paths):
        raise ConfigError("tiers.disk", [d.path for d in disks], "the same path is listed twice")
    return tuple(disks)


def _parse_io(io: dict[str, Any]) -> IoConfig:
    check_keys("io", io, {"engine", "queue_depth", "timeout_s", "breaker_threshold",
                          "breaker_cooldown_s"})
    engine = choice_field("io.engine", io.get("engine", "auto"), IO_ENGINES)
    return IoConfig(
        engine=engine,
        queue_depth=int_field("io.queue_depth", io.get("queue_depth", 64), 1, 4096),
        timeout_s=seconds_field("io.timeout_s", io.get("timeout_s", 30.0)),
        breaker_threshold=int_field("io.breaker_threshold", io.get("breaker_threshold", 3), 1, 1 << 20),
        breaker_cooldown_s=seconds_field("io.breaker_cooldown_s", io.get("breaker_cooldown_s", 5.0)),
    )


def _parse_service(service: dict[str, Any]) -> ServiceConfig:
    check_keys("service", service, {"socket", "spawn", "staging", "metrics_port"})
    default = ServiceConfig()
    socket = service.get("socket", default.socket)
    if not isinstance(socket, str) or not socket or len(socket.encode()) > 107:
        raise ConfigError("service.socket", socket, "must be a Unix socket path of at most 107 bytes")
    spawn = service.get("spawn", True)
    if not isinstance(spawn, bool):
        raise ConfigError("service.spawn", spawn, "must be true or false")
    return ServiceConfig(socket=socket, spawn=spawn,
                         staging=size_field("service.staging", service.get("staging", default.staging),
                                       minimum=1 << 20),
                         metrics_port=int_field("service.metrics_port", service.get("metrics_port", 0),
                                                0, 65535))


def dump_config(config: StoreConfig) -> dict[str, Any]:
    """The schema form of a config (what `load_config` reads back), for handing to
    a spawned service and for comparing two configs."""
    tiers: dict[str, Any] = {}
    if config.host is not None:
        tiers["host"] = {"capacity": config.host.capacity}
        if config.host.shm_name:
            tiers["host"]["shm_name"] = config.host.shm_name
    if config.disk:
        tiers["disk"] = [{"path": d.path, "capacity": d.capacity} for d in config.disk]
    if config.nvmeof is not None:
        tiers["nvmeof"] = dump_nvmeof(config.nvmeof)
    return {
        "chunk_tokens": config.chunk_tokens,
        "tiers": tiers,
        "io": dataclasses.asdict(config.io),
        "write_behind_chunks": config.write_behind_chunks,
        "promote_on_hit": config.promote_on_hit,
        "prefetch_inflight": config.prefetch_inflight,
        "write_policy": config.write_policy,
        "disk_min_seen": config.disk_min_seen,
        "service": {"socket": config.service.socket, "spawn": config.service.spawn,
                    "staging": config.service.staging, "metrics_port": config.service.metrics_port},
    }
