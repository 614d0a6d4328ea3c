"""Two hosts, one array, as the cluster tests set them up: each host's config (its own
disk, its peers' disks, the index at `url`), its client, and puts, gets and waits
through that client."""

from __future__ import annotations

import os
import time

import numpy as np

from kvstore.config.store import load_config
from kvstore.devices.layout import geometry
from kvstore.format.record import record_bytes
from kvstore.service.client import StoreClient
from support.services import service_config

CHUNK = 64 * 1024
LEASE_S = 1.5
DEADLINE_S = 0.2
IO_TIMEOUT_S = 5.0  # a busy machine's I/O (a superblock read missed 0.5 s); deadline tests ask less
SLOTS = 4


def capacity_for(slots: int) -> int:
    """The smallest disk capacity that holds exactly `slots` records of CHUNK bytes."""
    capacity = slots * record_bytes(CHUNK)
    while geometry(capacity, record_bytes(CHUNK))[0] < slots:
        capacity += 4096
    return capacity


def host_config(name: str, others: list[str], root: str, url: str, *, dram: str | None = None,
                sockets: str | None = None, io_timeout_s: float = IO_TIMEOUT_S, **extra) -> dict:
    """Host `name`'s config: a disk of SLOTS records at `root/name`, the disks of `others`
    as its peers', the index at `url`; with `sockets`, a service whose socket is there."""
    tiers: dict = {"disk": [{"path": os.path.join(root, name), "capacity": capacity_for(SLOTS)}]}
    if dram:
        tiers["dram"] = {"capacity": dram}
    config = {"tiers": tiers, "io": {"engine": "threads", "queue_depth": 8, "timeout_s": io_timeout_s,
                                     "breaker_cooldown_s": 0.3},
              "cluster": {"host_id": name, "index_url": url, "lease_s": LEASE_S,
                          "index_deadline_s": DEADLINE_S, "index_backoff_s": 0.3,
                          "peers": [{"host_id": other, "disk": [{"path": os.path.join(root, other),
                                                                 "capacity": capacity_for(SLOTS)}]}
                                    for other in others]}, **extra}
    if sockets:
        config["service"] = service_config(sockets, socket=f"{name}.sock")["service"]
    return config


def client(config: dict) -> StoreClient:
    return StoreClient(load_config(config), CHUNK)


def put(store: StoreClient, keys: list[bytes], payloads: list[np.ndarray]) -> list[bool]:
    for i, payload in enumerate(payloads):
        store.memory.slot(i)[:] = payload
    return store.put(keys, list(range(len(keys))))


def get(store: StoreClient, keys: list[bytes]) -> tuple[list[bool], list[bytes]]:
    ok = store.get(keys, list(range(len(keys))))
    return ok, [bytes(store.memory.slot(i)) for i in range(len(keys))]


def wait_for(condition, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout_s} s")
        time.sleep(0.1)
    return value


def found(store: StoreClient, keys: list[bytes]) -> int:
    return store.residency(keys)[0]
