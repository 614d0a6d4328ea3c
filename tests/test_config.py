import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvstore.config.store import dump_config, load_config, with_service
from kvstore.format.errors import ConfigError
from kvstore.format.units import format_size, parse_size

GOOD_YAML = """
chunk_tokens: 256
tiers:
  dram: {capacity: 8GiB}
  disk:
    - {path: /mnt/nvme0/kvstore, capacity: 500GiB}
    - {path: /dev/nvme1n1, capacity: 1TiB}
io: {engine: auto, queue_depth: 64}
"""


def test_the_documented_example_loads(tmp_path):
    path = tmp_path / "kvstore.yaml"
    path.write_text(GOOD_YAML)
    config = load_config(str(path))
    assert config.dram.capacity == 8 << 30
    assert [d.capacity for d in config.disk] == [500 << 30, 1 << 40]
    assert config.io.queue_depth == 64
    assert load_config(GOOD_YAML) == config


@pytest.mark.parametrize("data,field", [
    ({"tiers": {"dram": {"capacity": "8GiB"}, "ssd": {}}}, "tiers.ssd"),
    ({"tiers": {"dram": {"capacity": "lots"}}}, "tiers.dram.capacity"),
    ({"tiers": {"dram": {}}}, "tiers.dram.capacity"),
    ({"tiers": {"disk": [{"path": "/x"}]}}, "tiers.disk[0].capacity"),
    ({"tiers": {"disk": [{"capacity": "1GiB"}]}}, "tiers.disk[0].path"),
    ({"tiers": {"dram": {"capacity": "1GiB"}}, "io": {"engine": "aio"}}, "io.engine"),
    ({"tiers": {"dram": {"capacity": "1GiB"}}, "io": {"queue_depth": 0}}, "io.queue_depth"),
    ({"tiers": {"dram": {"capacity": "1GiB"}}, "chunk_tokens": "many"}, "chunk_tokens"),
    ({"tiers": {}}, "tiers"),
    ({"tiers": {"dram": {"capacity": "1GiB"}}, "colour": "red"}, "colour"),
    ({"tiers": {"dram": {"capacity": "1GiB"}}, "dram_clean_ahead": "-1GiB"}, "dram_clean_ahead"),
    ({"tiers": {"disk": [{"path": "/a", "capacity": 1}, {"path": "/a", "capacity": 1}]}},
     "tiers.disk"),
])
def test_bad_config_names_the_field_and_value(data, field):
    with pytest.raises(ConfigError) as caught:
        load_config(data)
    assert caught.value.field == field
    assert f"'{field}'" in str(caught.value)


def test_missing_file_and_bad_yaml_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config("tiers: [unclosed\n")


def test_sizes():
    assert parse_size("16GiB") == 16 << 30
    assert parse_size("4 MiB") == 4 << 20
    assert parse_size("1.5KiB") == 1536
    assert parse_size(512) == 512
    for bad in ("12 parsecs", "-1", True, "GiB"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert format_size(4 << 20) == "4MiB"


def test_inline_json_longer_than_a_file_name_is_read_as_json():
    long_socket = "/tmp/" + "s" * 90 + ".sock"
    text = json.dumps({"tiers": {"dram": {"capacity": "1GiB"}}, "service": {"socket": long_socket},
                       "write_behind_chunks": 64, "promote_on_hit": True, "prefetch_inflight": "256MiB",
                       "io": {"engine": "auto", "queue_depth": 64, "timeout_s": 30.0}})
    assert len(text) > 255
    assert load_config(text).service.socket == long_socket


# -- the schema's error paths ----------------------------------------------------------

DRAM = {"dram": {"capacity": "1GiB"}}


@pytest.mark.parametrize("data,field,words", [
    ({"tiers": {"disk": [{"path": "/a", "capacity": "1GiB"}, {"path": "/b", "capacity": "lots"}]}},
     "tiers.disk[1].capacity", "not a size"),
    ({"tiers": {"disk": [{"path": "/a", "capacity": "1GiB"}, {"path": "", "capacity": 1}]}},
     "tiers.disk[1].path", "non-empty"),
    ({"tiers": {"disk": [{"path": "/a", "capacity": 1, "size": 2}]}}, "tiers.disk[0].size",
     "unknown key (allowed: capacity, path)"),
    ({"tiers": {"disk": {"path": "/a"}}}, "tiers.disk[0].capacity", "required"),  # one mapping
    ({"tiers": {"disk": "/a"}}, "tiers.disk", "must be a list"),
    ({"tiers": {"dram": "8GiB"}}, "tiers.dram", "must be a mapping"),
    ({"tiers": DRAM, "io": {"engine": "aio"}}, "io.engine", "auto, uring, threads"),
    ({"tiers": DRAM, "io": {"queueDepth": 8}}, "io.queueDepth",
     "allowed: breaker_cooldown_s, breaker_threshold, engine, queue_depth, timeout_s"),
    ({"tiers": DRAM, "service": {"socket": "/tmp/" + "s" * 120}}, "service.socket", "107 bytes"),
    ({"tiers": DRAM, "service": {"metrics_port": 70000}}, "service.metrics_port", "between 0 and 65535"),
    ({"tiers": DRAM, "service": {"staging": "4KiB"}}, "service.staging", "at least 1048576 bytes"),
    ({"tiers": DRAM, "io": {"timeout_s": 0}}, "io.timeout_s", "above 0"),
    ({"tiers": DRAM, "io": {"timeout_s": "30s"}}, "io.timeout_s", "seconds"),
    ({"tiers": DRAM, "write_policy": "sometimes"}, "write_policy", "write_back, write_through"),
    ({"tiers": DRAM, "io": None}, "io", "must be a mapping"),
    ({"tiers": DRAM, "write_policy": "write_through", "disk_admission": "tinylfu"}, "disk_admission",
     "write_policy write_through writes every chunk to disk, so disk_admission 'tinylfu' would refuse"),
    ({"tiers": DRAM, "write_policy": "write_through", "disk_min_seen": 3}, "disk_admission",
     "'second-touch' would refuse none"),
    ({}, "tiers", "at least one tier"),
])
def test_errors_name_the_dotted_path(data, field, words):
    with pytest.raises(ConfigError) as caught:
        load_config(data)
    assert caught.value.field == field
    assert words in caught.value.reason


@pytest.mark.parametrize("change,field", [
    ({"promote_on_hit": 1}, "promote_on_hit"), ({"promote_on_hit": "true"}, "promote_on_hit"),
    ({"chunk_tokens": True}, "chunk_tokens"), ({"chunk_tokens": 256.0}, "chunk_tokens"),
    ({"chunk_tokens": "256"}, "chunk_tokens"), ({"write_behind_chunks": False}, "write_behind_chunks"),
    ({"disk_min_seen": 1.5}, "disk_min_seen"), ({"service": {"spawn": 0}}, "service.spawn"),
    ({"io": {"queue_depth": True}}, "io.queue_depth"), ({"io": {"breaker_cooldown_s": False}},
                                                        "io.breaker_cooldown_s"),
])
def test_booleans_and_integers_are_strict(change, field):
    with pytest.raises(ConfigError) as caught:
        load_config({"tiers": DRAM, **change})
    assert caught.value.field == field


def test_sizes_take_strings_and_integers():
    config = load_config({"tiers": {"dram": {"capacity": "1.5GiB"},
                                    "disk": [{"path": "/a", "capacity": 4096}]},
                          "prefetch_inflight": "64 MiB", "service": {"staging": "2MiB"}})
    assert config.dram.capacity == 3 << 29 and config.disk[0].capacity == 4096
    assert config.prefetch_inflight == 64 << 20 and config.service.staging == 2 << 20
    for bad in (-1, True, "1 parsec", 1.5):
        with pytest.raises(ConfigError) as caught:
            load_config({"tiers": {"dram": {"capacity": bad}}})
        assert caught.value.field == "tiers.dram.capacity"


def test_write_behind_chunks_zero_is_refused():
    """0 once silently turned demotion to disk off; a disk tier always gets a write-behind queue."""
    with pytest.raises(ConfigError) as caught:
        load_config({"tiers": DRAM, "write_behind_chunks": 0})
    assert caught.value.field == "write_behind_chunks" and "at least 1" in caught.value.reason
    assert load_config({"tiers": DRAM, "write_behind_chunks": 1}).write_behind_chunks == 1


def test_shm_name_was_removed():
    with pytest.raises(ConfigError) as caught:
        load_config({"tiers": {"dram": {"capacity": "1GiB", "shm_name": "kv"}}})
    assert caught.value.field == "tiers.dram.shm_name" and "removed" in caught.value.reason


def test_host_is_the_dram_tiers_old_key(tmp_path):
    """A config written before the DRAM tier's key was `dram` (`tiers.host`) loads as that
    tier, from a file as from an engine's dict; giving both spellings is refused."""
    path = tmp_path / "old.yaml"
    path.write_text(GOOD_YAML.replace("dram:", "host:"))
    assert load_config(str(path)) == load_config(GOOD_YAML)
    assert load_config({"tiers": {"host": {"capacity": "1GiB"}}}).dram.capacity == 1 << 30
    with pytest.raises(ConfigError) as caught:
        load_config({"tiers": {"host": {"capacity": "1GiB"}, "dram": {"capacity": "2GiB"}}})
    assert caught.value.field == "tiers.host" and "`dram`" in caught.value.reason
    with pytest.raises(ConfigError) as caught:
        load_config({"tiers": {"host": {"capacity": "lots"}}})
    assert caught.value.field == "tiers.dram.capacity"


def test_configs_are_frozen_values():
    first = load_config({"tiers": DRAM})
    second = load_config(json.dumps({"tiers": {"dram": {"capacity": 1 << 30}}}))
    assert first == second and hash(first) == hash(second)
    assert dump_config(first) == dump_config(second)
    assert dump_config(first) != dump_config(load_config({"tiers": DRAM, "write_behind_chunks": 3}))
    with pytest.raises(ValidationError):
        first.chunk_tokens = 16


def test_with_service_validates_the_change():
    config = load_config({"tiers": DRAM})
    moved = with_service(config, socket="/tmp/other.sock", spawn=False)
    assert (moved.service.socket, moved.service.spawn, moved.dram) == ("/tmp/other.sock", False, config.dram)
    with pytest.raises(ConfigError) as caught:
        with_service(config, socket="")
    assert caught.value.field == "service.socket"


# -- dump_config / load_config round trip ----------------------------------------------

_sizes = st.one_of(st.integers(1 << 20, 1 << 42),
                   st.sampled_from(["1MiB", "8GiB", "1.5GiB", "500GB", "2TiB"]))
_seconds = st.floats(0.001, 3600, allow_nan=False)
_ips = st.ip_addresses().map(str)
_nqns = st.from_regex(r"nqn\.20[0-9]{2}-[01][0-9]\.io\.[a-z]{1,12}:[a-z0-9]{1,20}", fullmatch=True)
_connection = {
    "transport": st.sampled_from(["tcp", "rdma"]), "traddr": _ips, "trsvcid": st.integers(1, 65535),
    "hostnqn": _nqns, "nr_io_queues": st.none() | st.integers(1, 1024),
    "queue_size": st.none() | st.integers(16, 65536),
    "ctrl_loss_tmo": st.none() | st.just(-1) | st.integers(60, 1 << 20),
    "reconnect_delay": st.none() | st.integers(1, 60), "fast_io_fail_tmo": st.none() | st.integers(-1, 60),
}


@st.composite
def _nvmeof(draw):
    shared = {key: value for key, value in _connection.items() if key != "traddr"}
    tier = draw(st.fixed_dictionaries({"subnqn": _nqns, "traddr": _ips}, optional={
        **shared, "sysfs_root": st.sampled_from(["/sys", "/host/sys"]), "health_interval_s": _seconds}))
    namespaces = []
    for i in range(draw(st.integers(1, 4))):
        entry = draw(st.fixed_dictionaries({"capacity": _sizes}, optional=_connection))
        which = draw(st.sampled_from(["nsid", "uuid"]))
        entry[which] = i + 1 if which == "nsid" else str(draw(st.uuids()))
        namespaces.append(entry)
    return {**tier, "namespaces": namespaces}


_tiers = st.fixed_dictionaries({}, optional={
    "dram": st.fixed_dictionaries({"capacity": _sizes}),
    "disk": st.lists(_sizes, max_size=3).map(
        lambda caps: [{"path": f"/mnt/kv{i}", "capacity": cap} for i, cap in enumerate(caps)]),
    "nvmeof": _nvmeof(),
}).filter(lambda tiers: tiers.get("dram") or tiers.get("disk") or tiers.get("nvmeof"))

_configs = st.fixed_dictionaries({"tiers": _tiers}, optional={
    "chunk_tokens": st.integers(1, 1 << 20), "write_behind_chunks": st.integers(1, 1 << 20),
    "promote_on_hit": st.booleans(), "prefetch_inflight": _sizes, "disk_min_seen": st.integers(1, 100),
    "dram_clean_ahead": st.none() | st.just(0) | _sizes,
    "write_policy": st.sampled_from(["write_back", "write_through"]),
    "io": st.fixed_dictionaries({}, optional={
        "engine": st.sampled_from(["auto", "uring", "threads"]), "queue_depth": st.integers(1, 4096),
        "timeout_s": _seconds, "breaker_threshold": st.integers(1, 100), "breaker_cooldown_s": _seconds}),
    "service": st.fixed_dictionaries({}, optional={
        "socket": st.from_regex(r"/tmp/[a-z0-9]{1,40}\.sock", fullmatch=True), "spawn": st.booleans(),
        "staging": st.integers(1 << 20, 1 << 30), "metrics_port": st.integers(0, 65535)}),
}).filter(lambda c: c.get("write_policy") != "write_through" or c.get("disk_min_seen", 1) == 1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_configs)
def test_dump_then_load_gives_the_same_config(data):
    config = load_config(data)
    dumped = dump_config(config)
    assert load_config(dumped) == config
    assert load_config(json.dumps(dumped)) == config  # what a spawned service is handed
    assert dump_config(load_config(dumped)) == dumped


_CPU_ITEMS = st.integers(-5, 5000) | st.booleans() | st.text(max_size=3)
_CPU_TEXT = st.from_regex(r"[0-9]{1,12}(-[0-9]{1,12})?(,[0-9]{1,5})*", fullmatch=True)


@given(st.one_of(st.text(max_size=40), _CPU_TEXT, st.lists(_CPU_ITEMS, max_size=8), st.integers(),
                 st.floats(allow_nan=True), st.none(),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)))
def test_a_cpu_list_takes_linux_lists_and_refuses_anything_else_with_a_config_error(value):
    """`load_copy_cpus` as an operator may write it (`3`, `2-3,6`, [1, 2]); any other value
    is a ConfigError naming the key, never another exception."""
    from engine_plugin.vllm.core.options import parse_options

    extra = {"config": {"tiers": {"dram": {"capacity": "1GiB"}}}, "load_copy_cpus": value}
    try:
        cpus = parse_options(extra).load_copy_cpus
    except ConfigError as exc:
        assert "load_copy_cpus" in str(exc)
        return
    assert cpus == tuple(sorted(set(cpus))) and all(0 <= cpu < 4096 for cpu in cpus)


def test_a_cpu_list_reads_as_taskset_writes_it():
    from engine_plugin.vllm.core.options import parse_options

    def cpus(value):
        return parse_options({"config": {"tiers": {"dram": {"capacity": "1GiB"}}}, "load_copy_cpus": value}
                             ).load_copy_cpus

    assert cpus("3") == (3,) and cpus("6,2-3") == (2, 3, 6) and cpus([1, 1, 0]) == (0, 1)
    assert parse_options({"config": {"tiers": {"dram": {"capacity": "1GiB"}}}}).load_copy_cpus == ()
    for bad in ("", "1-", "a", "3-1x", "3-1", [True], [4096], "1,,2", "1-99999", "0-99999999999", "99999"):
        with pytest.raises(ConfigError, match="load_copy_cpus"):
            cpus(bad)
