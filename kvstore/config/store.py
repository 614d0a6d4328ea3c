"""The store's config schema (YAML file, JSON text or dict), validated on load.

Every error is a ConfigError that names the dotted field and the bad value, because
a config is usually written by hand and read by a service that fails at start-up.
The models below are the only statement of the keys, their defaults and their meaning:
docs/configuration.md's key table is generated from them (`python -m scripts.config_doc`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import yaml
from pydantic import Field, field_validator, model_validator

from kvstore.config.nvmeof import NvmeofConfig
from kvstore.config.runtime import default_socket
from kvstore.config.schema import (
    Bool,
    Kind,
    Refused,
    Schema,
    Text,
    choice,
    fraction,
    integer,
    seconds,
    size,
    validate,
    write_rate,
)
from kvstore.format.errors import ConfigError


class DramTierConfig(Schema):
    """The DRAM tier: one slab of private memory in the service."""

    removed_keys = {"shm_name": "removed: the DRAM slab is the service's private memory "
                                "(nothing mapped /dev/shm/NAME); delete this key"}

    capacity: Annotated[int, size()] = Field(
        description="DRAM slab size; sizes take `B`, `KiB`, `MiB`, `GiB`, `TiB` (and decimal `KB`, "
                    "`MB`, ...) or a number of bytes")


class DiskPathConfig(Schema):
    """One disk path: a directory (a preallocated file inside) or a raw block device."""

    path: Text = Field(
        description="a directory (kvstore creates it if its parent exists, and a preallocated "
                    "`kvstore.data` inside) or a raw block device")
    capacity: Annotated[int, size()] = Field(
        description="bytes kvstore may use on that path, metadata included; never exceeded")


def _disk_as_list(data: Any) -> Any:
    """`disk` may be one mapping, or null for none."""
    if isinstance(data, dict) and "disk" in data and not isinstance(data["disk"], list):
        return {**data, "disk": [data["disk"]] if isinstance(data["disk"], dict) else data["disk"] or []}
    return data


class TiersConfig(Schema):
    """Where chunks live: at least one of DRAM, disk paths, NVMe-oF namespaces."""

    dram: DramTierConfig | None = Field(
        None, description="the DRAM tier (`host` is its old spelling, still accepted); none: no DRAM tier")
    disk: tuple[DiskPathConfig, ...] = Field(
        (), description="disk paths (one mapping, or a list) striped round-robin with the "
                        "NVMe-oF namespaces as one block tier")
    nvmeof: NvmeofConfig | None = Field(
        None, description="NVMe-over-Fabrics namespaces to stripe over, found by subsystem NQN and "
                          "NSID or UUID: see [nvmeof.md](nvmeof.md) for every key")

    @classmethod
    def reshape(cls, data: Any) -> Any:
        """`host` is the DRAM tier's old key, read as `dram`; `disk` may be one mapping."""
        if isinstance(data, dict) and "host" in data:
            if "dram" in data:
                raise Refused("`host` is the old spelling of `dram`: give the DRAM tier once, as `dram`",
                              "host", value=data["host"])
            data = {("dram" if key == "host" else key): value for key, value in data.items()}
        return _disk_as_list(data)

    @model_validator(mode="after")
    def _usable(self) -> TiersConfig:
        if self.dram is None and not self.disk and self.nvmeof is None:
            raise Refused("configure at least one tier (dram, disk or nvmeof)")
        paths = [os.path.realpath(d.path) for d in self.disk]
        if len(set(paths)) != len(paths):
            raise Refused("the same path is listed twice", "disk", value=[d.path for d in self.disk])
        return self


class IoConfig(Schema):
    """How tier I/O runs, and when a faulting device is taken out of service."""

    engine: Annotated[str, choice("auto", "uring", "threads")] = Field(
        "auto", description="`uring` (io_uring), `threads` (preadv/pwritev pool), or `auto`: io_uring "
                            "if a ring can be set up, else threads with a logged reason")
    queue_depth: Annotated[int, integer(1, 4096)] = Field(
        64, description="requests in flight per batch, at most (a read batch keeps a quarter of "
                        "each device's share in flight where that is fewer, at least 16; and "
                        "threads per device in the `threads` pool)")
    timeout_s: Annotated[float, seconds()] = Field(
        30.0, description="deadline of every disk batch; a request past it is a counted miss")
    breaker_threshold: Annotated[int, integer(1, 1 << 20)] = Field(
        3, description="a disk or NVMe-oF device whose I/O faults (EIO, ENOLINK, ENODEV, ENXIO, "
                       "ETIMEDOUT, a missed deadline, a short transfer) this many times in a row is "
                       "taken out of service: its chunks become misses at once")
    breaker_cooldown_s: Annotated[float, seconds()] = Field(
        5.0, description="a tripped device is probed and revalidated after this long "
                         "(see [nvmeof.md](nvmeof.md))")


CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


def cluster_nodes(url: str) -> list[tuple[str, int]]:
    """The startup nodes a `redis+cluster://` URL lists; ValueError naming what is wrong."""
    parts = urlsplit(url)
    hosts = parts.netloc.rpartition("@")[2]
    if parts.path not in ("", "/", "/0") or parts.query or parts.fragment:
        raise ValueError("a Redis Cluster URL names nodes only (a cluster has database 0 alone): "
                         "redis+cluster://HOST:PORT[,HOST:PORT...]")
    nodes = []
    for node in hosts.split(","):
        host, colon, port = node.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"cluster node {node!r} is not HOST:PORT: "
                             "redis+cluster://HOST:PORT[,HOST:PORT...]")
        nodes.append((host.strip("[]"), int(port)))
    return nodes


def _index_url(value: Any) -> str:
    if isinstance(value, str) and value.startswith(CLUSTER_SCHEMES):
        cluster_nodes(value)  # ValueError naming what is wrong
        return value
    if not isinstance(value, str) or not value.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("must be a Redis URL: redis://HOST:PORT/DB, rediss://... (TLS), "
                         "unix:///path/to/redis.sock, or a Redis Cluster's "
                         "redis+cluster://HOST:PORT[,HOST:PORT...]")
    return value


TLS_SCHEMES = ("rediss://", "rediss+cluster://")


class IndexTlsConfig(Schema):
    """TLS to the index (a `rediss://` or `rediss+cluster://` URL): the CA that signs the
    index's certificate and, where Redis asks clients for one (`tls-auth-clients`), this
    host's certificate and key."""

    ca_file: Text | None = Field(
        None, description="CA certificates (PEM) the index's server certificate must chain to; "
                          "none: the system's; the certificate must also name the host in the URL")
    cert_file: Text | None = Field(
        None, description="this host's client certificate (PEM), for an index that requires one")
    key_file: Text | None = Field(
        None, description="the private key (PEM) of `cert_file`; keep it readable by this user only")

    @model_validator(mode="after")
    def _pair(self) -> IndexTlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise Refused("give cert_file and key_file together (a client certificate and its key)",
                          "key_file" if self.key_file is None else "cert_file", value=None)
        return self

    def options(self) -> dict[str, str]:
        """redis-py's keyword arguments for these files."""
        given = {"ssl_ca_certs": self.ca_file, "ssl_certfile": self.cert_file, "ssl_keyfile": self.key_file}
        return {name: path for name, path in given.items() if path is not None}


class PeerConfig(Schema):
    """Another host of the cluster whose block-tier devices this host may read."""

    host_id: Text = Field(description="that host's `cluster.host_id`")
    disk: tuple[DiskPathConfig, ...] = Field(
        (), description="that host's `tiers.disk`, exactly as its config lists them: the order "
                        "numbers its devices; opened read-only here (never created or written), "
                        "and one this host cannot open yet is retried in the background")
    nvmeof: NvmeofConfig | None = Field(
        None, description="that host's `tiers.nvmeof`, exactly as its config lists it (resolved "
                          "here by NQN and NSID or UUID, and probed like this host's own)")

    @classmethod
    def reshape(cls, data: Any) -> Any:
        """`disk` may be one mapping, as in `tiers`."""
        return _disk_as_list(data)

    @model_validator(mode="after")
    def _has_devices(self) -> PeerConfig:
        if not self.disk and self.nvmeof is None:
            raise Refused("list the peer's disk paths or nvmeof namespaces", "disk", value=None)
        return self


class ClusterConfig(Schema):
    """Several hosts sharing one array: a cross-host index of which host holds which chunk
    (a hint; records stay the truth) and read-only access to peers' devices."""

    host_id: Text = Field(description="this host's id in the index; unique in the cluster")
    index_url: Annotated[str, Kind("Redis URL", _index_url, lambda value: f"`{value}`")] = Field(
        description="the index (Redis or Valkey): `redis://HOST:PORT/DB`, `rediss://` (TLS) or "
                    "`unix://`; a Redis Cluster: `redis+cluster://HOST:PORT[,HOST:PORT...]` "
                    "(`rediss+cluster://`: TLS), some of its nodes, from which the client learns the "
                    "rest. A password or an ACL user goes in it: `redis://USER:PASSWORD@HOST:PORT/DB` "
                    "(printed and logged as `USER:***`; keep the config file private)")
    index_tls: IndexTlsConfig | None = Field(
        None, description="TLS files for a `rediss://` index; none: the system's CAs, no client "
                          "certificate")
    index_deadline_s: Annotated[float, seconds()] = Field(
        0.2, description="a lookup's index read must answer within this; past it (or with the index "
                         "down) the lookup is local only")
    index_backoff_s: Annotated[float, seconds()] = Field(
        1.0, description="after an index read fails or misses its deadline, lookups skip the index "
                         "this long (`peer.index_skipped`)")
    lease_s: Annotated[float, seconds()] = Field(
        10.0, description="this host's entries count only while its lease lives; renewed every "
                          "`lease_s`/3, so a stopped host's entries are ignored after at most this long")
    republish_s: Annotated[float, seconds(zero=True)] = Field(
        600.0, description="every entry of this host is sent to the index again within this, a share "
                           "at each lease renewal, so entries the index lost without an error (a Redis "
                           "Cluster master that died before its replica had them) come back; 0: never")
    key_prefix: Text = Field(
        "kvstore:", description="prefix of every index key (clusters may share one Redis); with a "
                                "Redis Cluster index, no `{` or `}` (hash tags)")
    peers: tuple[PeerConfig, ...] = Field(
        (), description="hosts whose devices this host may read; the others' index entries are ignored")

    @model_validator(mode="after")
    def _no_hash_tag_on_a_cluster(self) -> ClusterConfig:
        """One instance takes any prefix (as it always has); a cluster's would place keys."""
        if self.index_url.startswith(CLUSTER_SCHEMES) and ("{" in self.key_prefix or "}" in self.key_prefix):
            raise Refused("must not contain { or } with a Redis Cluster index: they would put every key "
                          "in one hash slot", "key_prefix", value=self.key_prefix)
        return self

    @model_validator(mode="after")
    def _tls_with_rediss(self) -> ClusterConfig:
        if self.index_tls is not None and not self.index_url.startswith(TLS_SCHEMES):
            raise Refused("TLS files are for a rediss:// or rediss+cluster:// index_url", "index_tls",
                          value=None)
        return self

    @model_validator(mode="after")
    def _distinct_hosts(self) -> ClusterConfig:
        seen = {self.host_id}
        for i, peer in enumerate(self.peers):
            if peer.host_id in seen:
                raise Refused("listed twice (or this host's own id)", "peers", i, "host_id",
                              value=peer.host_id)
            seen.add(peer.host_id)
        return self


def _socket_path(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value.encode()) > 107:
        raise ValueError("must be a Unix socket path of at most 107 bytes")
    return value


class ServiceConfig(Schema):
    """The per-host service (`kvstore serve`) that engine plugins talk to."""

    socket: Annotated[str, Kind("path", _socket_path)] = Field(
        default_factory=default_socket,
        description="Unix socket of the per-host service (`kvstore serve`) that engine plugins use; "
                    "its directory must be this user's and writable by no one else (it is created "
                    "0700 if missing) and also holds `SOCKET.lock`, `SOCKET.log` and `SOCKET.json`",
        json_schema_extra={"doc_default": "`$XDG_RUNTIME_DIR/kvstore/kvstore.sock`, else "
                                          "`/tmp/kvstore-UID/kvstore.sock`"})
    spawn: Bool = Field(
        True, description="a client that finds no service starts one (detached, so it outlives the "
                          "engine and keeps its DRAM tier); false: start it yourself")
    staging: Annotated[int, size(1 << 20)] = Field(
        256 << 20, description="shared-memory window per client through which chunks move; a load or "
                               "save of more chunks goes in waves of this size")
    metrics_port: Annotated[int, integer(0, 65535)] = Field(
        0, description="serve Prometheus metrics at `http://HOST:PORT/metrics` (counters, per-tier "
                       "chunks/bytes/capacity, read latency quantiles and histograms, device health); "
                       "0: off")
    metrics_host: Text = Field(
        "127.0.0.1", description="address the metrics listen on (`0.0.0.0`: every interface; the "
                                 "metrics name devices and count hits, so keep them off a shared "
                                 "network unless a scraper needs them)")
    allowed_uids: tuple[Annotated[int, integer(0, (1 << 32) - 2)], ...] = Field(
        (), description="other users whose engines may use this service (its own user always may); "
                        "they can read every cached chunk, so list only users who share the prompts",
        json_schema_extra={"doc_type": "list of uids"})
    allowed_gids: tuple[Annotated[int, integer(0, (1 << 32) - 2)], ...] = Field(
        (), description="groups whose members' engines may use this service (see `allowed_uids`)",
        json_schema_extra={"doc_type": "list of gids"})
    share_dram: Annotated[str, choice("own-user", "allowed", "off")] = Field(
        "own-user", description="which engines map the DRAM tier read-only and load a DRAM hit with "
                                "one copy straight out of it: `own-user` (engines running as the "
                                "service's user), `allowed` (also `allowed_uids` / `allowed_gids`: "
                                "they can then read every chunk in DRAM, not only prompts they know), "
                                "`off` (loads go through windows; the tier is private memory)")
    max_clients: Annotated[int, integer(1, 1 << 16)] = Field(
        256, description="connections served at once (a scheduler and two per worker per engine); "
                         "past it a client is refused (`clients.refused_full`) and retries later")
    max_clients_per_user: Annotated[int, integer(1, 1 << 16)] | None = Field(
        None, description="connections one user other than the service's own (an `allowed_uids` user, "
                          "each member of an `allowed_gids` group) may hold at once; past it that "
                          "user's next is refused (`clients.refused_user_share`). At most `max_clients`",
        json_schema_extra={"doc_default": "a quarter of `max_clients` (64), at least 1"})
    owner_reserved_clients: Annotated[int, integer(0, 1 << 16)] | None = Field(
        None, description="connections kept for the service's own user's engines: other users together "
                          "hold at most `max_clients` less this (`clients.refused_owner_reserve`), so "
                          "however many connections they open, the owner's engines connect and "
                          "reconnect. Less than `max_clients` where other users are allowed",
        json_schema_extra={"doc_default": "a quarter of `max_clients` (64)"})
    hello_timeout_s: Annotated[float, seconds()] = Field(
        10.0, description="a connection that has not said hello (the request every kvstore client "
                          "sends first, as soon as it connects) this long after it was accepted is "
                          "closed (`clients.hello_timeout`): a client that stays silent, or sends a "
                          "byte at a time, holds a connection and its thread no longer than this")
    scheduler_leases: Annotated[int, size()] = Field(
        2 << 30, description="DRAM chunks (in bytes, every rank's together) one user's engines may hold "
                             "pinned for loads their lookups decided (a scheduler's, from its lookup "
                             "until the load ends); their workers copy them out of the shared tier with "
                             "no request of their own. Past it a load fetches as without a lease "
                             "(`lease.over_budget`)")
    learned_save_s: Annotated[float, seconds()] = Field(
        300.0, description="`learned` disk admission: how often what it learned is written to "
                           "`SOCKET.learned` while the service runs (as well as when it stops), so a "
                           "service killed outright (SIGKILL, out of memory) loses at most this much of it")

    @property
    def user_share(self) -> int:
        """`max_clients_per_user`, or its default."""
        if self.max_clients_per_user is not None:
            return self.max_clients_per_user
        return max(1, self.max_clients // 4)

    @property
    def owner_reserve(self) -> int:
        """`owner_reserved_clients`, or its default."""
        if self.owner_reserved_clients is not None:
            return self.owner_reserved_clients
        return self.max_clients // 4

    @model_validator(mode="after")
    def _shares_fit(self) -> ServiceConfig:
        """A share or a reserve larger than the whole is a mistake, and so is a reserve that
        leaves nothing for the other users the config allows."""
        for key, value in (("max_clients_per_user", self.max_clients_per_user),
                           ("owner_reserved_clients", self.owner_reserved_clients)):
            if value is not None and value > self.max_clients:
                raise Refused(f"is more than max_clients ({self.max_clients}), the connections the "
                              "service serves in all: make it smaller, or max_clients larger", key,
                              value=value)
        if self.owner_reserve == self.max_clients and (self.allowed_uids or self.allowed_gids):
            raise Refused(f"keeps all of max_clients ({self.max_clients}) for the service's own user, "
                          "so the users allowed_uids / allowed_gids name could never connect: make it "
                          "smaller, or max_clients larger", "owner_reserved_clients",
                          value=self.owner_reserve)
        return self


class StoreConfig(Schema):
    """A whole kvstore config: its tiers and how chunks move between them."""

    chunk_tokens: Annotated[int, integer(1, 1 << 20)] = Field(
        256, description="tokens per chunk; one chunk is one record and one key")
    tiers: TiersConfig = Field({}, validate_default=True, description="where chunks live")
    io: IoConfig = Field(default_factory=IoConfig, description="tier I/O")
    write_behind_chunks: Annotated[int, integer(1, 1 << 20)] = Field(
        64, description="bound on chunks queued for the background disk writer (`write_through` "
                        "copies); past it a copy is skipped (`writethrough.dropped`) and the chunk "
                        "is written when evicted instead. (A DRAM victim not on disk yet is written "
                        "down before its slot is reused while a disk device serves: see "
                        "`dram_clean_ahead`.)")
    promote_on_hit: Bool = Field(
        True, description="a disk hit is read into a DRAM slot, so the next hit is a DRAM hit (and an "
                          "engine that maps the DRAM tier loads it from that slot: one copy)")
    put_inflight: Annotated[int, size()] = Field(
        1 << 30, description="the bytes of puts (engines' saves) the store writes at once, all clients "
                             "together; the chunks of a put past it are refused at once (`put.rejected`: a "
                             "save is best effort) instead of waiting behind the others")
    dram_clean_ahead: Annotated[int, size(0)] | None = Field(
        None, description="how much of the DRAM tier's coldest end a background cleaner keeps written "
                          "down to disk, so that a put takes a clean slot and never writes another "
                          "chunk down on its caller's thread (where the cleaner falls behind, a put's "
                          "chunks go straight to disk instead: `put.straight_to_disk`; the cleaner's "
                          "writes are `dram.cleaned`); 0: no cleaner, a put writes its victim down "
                          "itself (`dram.demoted`). "
                          "At most 1,024 chunks, whatever is set: each pass walks it under the DRAM "
                          "tier's lock",
        json_schema_extra={"doc_default": "`put_inflight`, at most a quarter of the DRAM tier and "
                                          "1,024 chunks"})
    prefetch_inflight: Annotated[int, size()] = Field(
        1 << 30, description="the bytes one prefetch (a promotion from disk to DRAM) reads at a time; "
                             "below `io.queue_depth` chunks it keeps the device's queue short")
    next_turn: Annotated[str, choice("predict", "warm", "off")] = Field(
        "predict", description="what the service does when a request ends (kvstore/tiers/next_turn.py): "
                               "`predict` learns when conversations come back and promotes a finished "
                               "request's chunks from disk into DRAM `next_turn_lead_s` before; `warm` "
                               "promotes them at once; `off` leaves them to LRU. At most 4,096 predictions "
                               "and hints wait, a uid other than the service's own at most a quarter of "
                               "them (its own oldest go first), and at most 16,384 prefix families are "
                               "remembered")
    next_turn_lead_s: Annotated[float, seconds(zero=True)] = Field(
        1.0, description="how long before a predicted return its chunks are brought into DRAM")
    write_policy: Annotated[str, choice("write_back", "write_through")] = Field(
        "write_back", description="`write_back`: DRAM's chunks reach disk when evicted (and at a clean "
                                  "shutdown); `write_through`: also as soon as they are stored, so a "
                                  "killed service loses nothing")
    disk_admission: Annotated[str, choice("all", "second-touch", "tinylfu", "predicted", "learned")] = Field(
        "all", description="which chunks leaving DRAM are written to disk (kvstore/tiers/admission.py; "
                           "measured in [replay.md](replay.md)): `all` (loses no hit); `second-touch`: one"
                           " seen (stored or read) `disk_min_seen` times while a bounded ghost list "
                           "remembers it; `tinylfu`: one a decaying frequency sketch counts "
                           "`disk_min_seen` times; `predicted`: as second-touch, or one whose prefix "
                           "family's chunks mostly come back; `learned`: one whose bucket (the answer "
                           "length, turn and idle time of the request that last named it, as the vLLM "
                           "connector reports them or the service infers them from SGLang's and "
                           "LMCache's puts) came back after leaving DRAM at least as often as a "
                           "threshold tuned to lose no more than `disk_admission_loss` of the hits. A "
                           "refused chunk is dropped from DRAM (`disk.admission_refused`). Default "
                           "`all`, or `learned` when a `disk_write_budget` is set. Only `all` goes with "
                           "`write_policy: write_through`, which writes every chunk",
        json_schema_extra={"doc_default": "`all` (`learned` with a `disk_write_budget`)"})
    disk_admission_loss: Annotated[float, fraction()] = Field(
        0.01, description="`learned`: the share of the store's hits disk admission may give up (hits a "
                          "refused chunk would have served, measured as refused chunks are asked for "
                          "again); its threshold starts at 0, admitting every chunk, and moves so the "
                          "loss measured stays within this (docs/replay.md). 0: the threshold is "
                          "`disk_admission_threshold` alone")
    disk_admission_threshold: Annotated[float, fraction()] = Field(
        0.0, description="`learned`: the least return rate a chunk's bucket needs for the chunk to be "
                         "written to disk (the share of its chunks stored or read again after leaving "
                         "DRAM), whatever `disk_admission_loss` allows; a `disk_write_budget` raises "
                         "the threshold further while writes would go over")
    disk_write_budget: Annotated[int | str, write_rate()] | None = Field(
        None, description="the most bytes written to the disk tier in any 24 hours: a size (e.g. `2TiB`) "
                          "or drive writes per day of the disk tier's capacity (e.g. `0.5 dwpd`); never "
                          "exceeded (at most an hour's worth is held for bursts). Admission's threshold "
                          "rises so that the chunks most likely to come back are the ones written; a "
                          "write it has no allowance for is not made (`disk.budget_refused`). none: no cap")
    disk_min_seen: Annotated[int, integer(1, 1 << 20)] = Field(
        2, description="the sightings (stores or reads) `second-touch`, `tinylfu` and `predicted` "
                       "ask of a chunk before writing it to disk; given above 1 without "
                       "`disk_admission`, it means `second-touch` (its meaning before that key)")
    eviction: Annotated[str, choice("lru", "cost")] = Field(
        "lru", description="what DRAM and disk evict first, always a chain's tail before its head: "
                           "`lru` the least recently used; `cost` the least valuable, a chunk's "
                           "value being its recompute cost (deeper in a prompt: dearer) on top of "
                           "a clock that ages it (GreedyDual; kvstore/tiers/policy.py)")
    service: ServiceConfig = Field(default_factory=ServiceConfig, description="the per-host service")
    cluster: ClusterConfig | None = Field(
        None, description="several hosts sharing one array: see [cluster.md](cluster.md); none: this "
                          "host serves only what it stored")

    @field_validator("write_behind_chunks", mode="before")
    @classmethod
    def _some_write_behind(cls, value: Any) -> Any:
        if value == 0 and not isinstance(value, bool):
            raise ValueError("must be at least 1: with 0 no write_through copy could be queued")
        return value

    @model_validator(mode="before")
    @classmethod
    def _default_admission(cls, data: Any) -> Any:
        """Without `disk_admission`: `learned` under a write budget (so the budget writes the
        chunks most likely to come back, not the first to leave DRAM); `second-touch` for
        `disk_min_seen` above 1 alone (before `disk_admission` existed, that turned admission
        on: such a config keeps that meaning instead of silently writing everything)."""
        if not isinstance(data, dict) or "disk_admission" in data:
            return data
        if data.get("disk_write_budget") is not None:
            return {**data, "disk_admission": "learned"}
        if isinstance(data.get("disk_min_seen"), int) and data["disk_min_seen"] > 1:
            return {**data, "disk_admission": "second-touch"}
        return data

    @model_validator(mode="after")
    def _write_through_admits_all(self) -> StoreConfig:
        """write_through writes every chunk down as it is stored and never refuses one (a
        PD producer relies on it), so an admission policy there would silently do nothing."""
        if self.write_policy == "write_through" and self.disk_write_budget is not None:
            raise Refused("write_policy write_through writes every chunk to disk as it is stored, so a "
                          "disk_write_budget could not be kept: leave it out or set write_policy to "
                          "`write_back`", "disk_write_budget", value=self.disk_write_budget)
        if self.write_policy == "write_through" and self.disk_admission != "all":
            raise Refused(f"write_policy write_through writes every chunk to disk, so disk_admission "
                          f"{self.disk_admission!r} would refuse none: set disk_admission to `all` "
                          f"(and leave disk_min_seen out) or write_policy to `write_back`",
                          "disk_admission", value=self.disk_admission)
        return self

    @property
    def dram(self) -> DramTierConfig | None:
        return self.tiers.dram

    @property
    def disk(self) -> tuple[DiskPathConfig, ...]:
        return self.tiers.disk

    @property
    def nvmeof(self) -> NvmeofConfig | None:
        return self.tiers.nvmeof


# What a SIGHUP reload applies to a running service (kvstore/service/server.py); engines
# started before it keep the config they started with, so a hello does not compare these.
LIVE_KEYS = ("disk_admission", "disk_min_seen", "disk_admission_threshold", "disk_admission_loss",
             "disk_write_budget", "eviction")


def load_config(source: StoreConfig | dict[str, Any] | str | os.PathLike[str]) -> StoreConfig:
    """Accept a StoreConfig, a dict, JSON/YAML text, or a path to a .yaml/.json file."""
    if isinstance(source, StoreConfig):
        return source
    if isinstance(source, dict):
        return validate(StoreConfig, source)
    text = str(source)
    path = Path(text)
    if _names_a_file(text, path):
        if not path.is_file():
            raise ConfigError("config", text, "file not found")
        text = _read_config_file(path)
    try:
        data = json.loads(text) if text.lstrip().startswith("{") else _yaml(text, str(source)[:80])
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError("config", str(source)[:80], f"not valid YAML/JSON: {exc}") from exc
    except RecursionError:
        raise ConfigError("config", str(source)[:80], "nested too deeply to be a config") from None
    if not isinstance(data, dict):
        raise ConfigError("config", str(data)[:80], "must be a mapping")
    _check_extent(data, str(source)[:80])
    return validate(StoreConfig, data)


MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_VALUES = 100_000  # YAML aliases make a short file a huge tree: counted as a tree
MAX_CONFIG_DEPTH = 32


def _read_config_file(path: Path) -> str:
    """The file's text; a ConfigError if it cannot be read, is over MAX_CONFIG_BYTES or
    is not UTF-8 (a service reloading it keeps its config: server.py)."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError("config", str(path), f"cannot be read: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError("config", str(path), f"is larger than {MAX_CONFIG_BYTES} bytes: not a config")
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise ConfigError("config", str(path), f"is not UTF-8 text (byte {exc.start} is not)") from None


def _yaml(text: str, source: str) -> Any:
    """The YAML document, refused past MAX_CONFIG_DEPTH while its events stream, before a
    deep file costs a recursive parse (seconds for 20,000 brackets)."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_CONFIG_DEPTH:
                raise ConfigError("config", source, "nested too deeply to be a config")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    return yaml.safe_load(text)


def _check_extent(data: Any, source: str) -> None:
    """Refuse a parsed config too deep or with too many values (as a tree: an alias counts
    every time it is used) before anything walks it whole."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    seen = 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_CONFIG_VALUES or depth > MAX_CONFIG_DEPTH:
            raise ConfigError("config", source, f"holds more than {MAX_CONFIG_VALUES} values or is nested "
                                                f"more than {MAX_CONFIG_DEPTH} deep: not a config")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children)


def _names_a_file(text: str, path: Path) -> bool:
    """A one-line source that is not inline JSON/YAML names a file. (Inline JSON can be
    longer than a path may be: asking the file system about it would fail.)"""
    if "\n" in text or text.lstrip().startswith("{"):
        return False
    try:
        return path.suffix in (".yaml", ".yml", ".json") or path.exists()
    except OSError:
        return False


def dump_config(config: StoreConfig) -> dict[str, Any]:
    """The schema form of a config, every key written out (what `load_config` reads back),
    for handing to a spawned service and for comparing two configs."""
    return config.model_dump(mode="json")


def with_service(config: StoreConfig, **changes: Any) -> StoreConfig:
    """`config` with some `service` keys changed (validated like the config file's)."""
    service = validate(ServiceConfig, {**config.service.model_dump(), **changes}, "service")
    return config.model_copy(update={"service": service})
