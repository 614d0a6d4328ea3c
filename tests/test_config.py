import pytest

from kvstore.config import load_config
from kvstore.errors import ConfigError
from kvstore.units import format_size, parse_size

GOOD_YAML = """
chunk_tokens: 256
tiers:
  host: {capacity: 8GiB}
  disk:
    - {path: /mnt/nvme0/kvstore, capacity: 500GiB}
    - {path: /dev/nvme1n1, capacity: 1TiB}
io: {engine: auto, queue_depth: 64}
"""


def test_the_documented_example_loads(tmp_path):
    path = tmp_path / "kvstore.yaml"
    path.write_text(GOOD_YAML)
    config = load_config(str(path))
    assert config.host.capacity == 8 << 30
    assert [d.capacity for d in config.disk] == [500 << 30, 1 << 40]
    assert config.io.queue_depth == 64
    assert load_config(GOOD_YAML) == config


@pytest.mark.parametrize("data,field", [
    ({"tiers": {"host": {"capacity": "8GiB"}, "ssd": {}}}, "tiers.ssd"),
    ({"tiers": {"host": {"capacity": "lots"}}}, "tiers.host.capacity"),
    ({"tiers": {"host": {}}}, "tiers.host.capacity"),
    ({"tiers": {"disk": [{"path": "/x"}]}}, "tiers.disk[0].capacity"),
    ({"tiers": {"disk": [{"capacity": "1GiB"}]}}, "tiers.disk[0].path"),
    ({"tiers": {"host": {"capacity": "1GiB"}}, "io": {"engine": "aio"}}, "io.engine"),
    ({"tiers": {"host": {"capacity": "1GiB"}}, "io": {"queue_depth": 0}}, "io.queue_depth"),
    ({"tiers": {"host": {"capacity": "1GiB"}}, "chunk_tokens": "many"}, "chunk_tokens"),
    ({"tiers": {}}, "tiers"),
    ({"tiers": {"host": {"capacity": "1GiB"}}, "colour": "red"}, "colour"),
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
    import json

    long_socket = "/tmp/" + "s" * 90 + ".sock"
    text = json.dumps({"tiers": {"host": {"capacity": "1GiB"}}, "service": {"socket": long_socket},
                       "write_behind_chunks": 64, "promote_on_hit": True, "prefetch_inflight": "256MiB",
                       "io": {"engine": "auto", "queue_depth": 64, "timeout_s": 30.0}})
    assert len(text) > 255
    assert load_config(text).service.socket == long_socket
