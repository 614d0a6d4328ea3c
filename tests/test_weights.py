"""The weights' fingerprint in every namespace: what it covers, its cache, and generations."""

from __future__ import annotations

import json
import os
import stat

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connectors.weights import FileDigests, WeightsUnknown, checkpoint_files, default_digests, fingerprint


def checkpoint(path, weights: bytes = b"w" * 1000, config: str = '{"layers": 2}') -> str:
    os.makedirs(path, exist_ok=True)
    (path / "model-00001-of-00002.safetensors").write_bytes(weights)
    (path / "model-00002-of-00002.safetensors").write_bytes(b"second shard")
    (path / "config.json").write_text(config)
    (path / "tokenizer.json").write_text("{}")
    return str(path)


def test_the_fingerprint_names_the_weight_and_config_files_by_content(tmp_path):
    digests = FileDigests(None)
    a = fingerprint(checkpoint(tmp_path / "a"), digests)
    assert a.startswith("xxh3:") and len(a) == 5 + 32
    assert fingerprint(checkpoint(tmp_path / "copy"), digests) == a  # another path, same weights
    assert fingerprint(checkpoint(tmp_path / "b", weights=b"w" * 999 + b"x"), digests) != a
    assert fingerprint(checkpoint(tmp_path / "c", config='{"layers": 3}'), digests) != a
    assert checkpoint_files(str(tmp_path / "a")) == ["config.json", "model-00001-of-00002.safetensors",
                                                      "model-00002-of-00002.safetensors"]
    (tmp_path / "a" / "tokenizer.json").write_text('{"other": 1}')  # does not shape the KV
    assert fingerprint(str(tmp_path / "a"), digests) == a


def test_pytorch_files_count_only_without_safetensors_and_none_is_an_error(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"bin")
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_files(str(tmp_path)) == ["config.json", "pytorch_model.bin"]
    (tmp_path / "model.safetensors").write_bytes(b"st")
    assert checkpoint_files(str(tmp_path)) == ["config.json", "model.safetensors"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(WeightsUnknown, match="no weight files"):
        fingerprint(str(empty), FileDigests(None))


def test_a_restart_takes_digests_from_the_cache_and_a_changed_file_is_hashed_again(tmp_path):
    model = checkpoint(tmp_path / "m")
    cache = str(tmp_path / "cache.json")
    first = fingerprint(model, FileDigests(cache))
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o600
    shard = tmp_path / "m" / "model-00001-of-00002.safetensors"
    before = os.stat(shard)
    # Other bytes, same size and mtime: only a digest from the cache still gives `first`
    # (the cache is keyed by device, inode, size and mtime, so this proves nothing re-read it).
    with open(shard, "r+b") as f:
        f.write(b"X")
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    restarted = FileDigests(cache)  # a new process: the cache file
    assert fingerprint(model, restarted) == first and restarted.hashed == 0
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns + 1))
    assert fingerprint(model, FileDigests(cache)) != first  # rewritten in place: hashed again


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200))
def test_a_damaged_cache_file_is_an_empty_cache(tmp_path, garbage):
    model = checkpoint(tmp_path / "m")
    cache = tmp_path / "cache.json"
    cache.write_bytes(garbage)
    assert fingerprint(model, FileDigests(str(cache))) == fingerprint(model, FileDigests(None))
    assert json.loads(cache.read_text())  # rewritten whole


def test_the_cache_lives_in_a_private_directory_or_not_at_all(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    digests = default_digests()
    assert digests.path == str(tmp_path / "xdg" / "kvstore" / "weight-digests.json")
    assert stat.S_IMODE(os.stat(tmp_path / "xdg" / "kvstore").st_mode) == 0o700
    os.chmod(tmp_path / "xdg" / "kvstore", 0o777)  # others could swap the file: not used
    assert default_digests().path is None
    link = tmp_path / "link-target"
    link.write_text("{}")
    os.chmod(tmp_path / "xdg" / "kvstore", 0o700)
    os.unlink(tmp_path / "xdg" / "kvstore" / "weight-digests.json")
    os.symlink(link, tmp_path / "xdg" / "kvstore" / "weight-digests.json")
    model = checkpoint(tmp_path / "m")
    assert fingerprint(model, default_digests()).startswith("xxh3:")  # a link is never followed
    assert link.read_text() == "{}"


def test_links_to_weight_files_are_read_like_a_hub_snapshot(tmp_path):
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / "abc").write_bytes(b"w" * 1000)
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    os.symlink(blobs / "abc", snapshot / "model-00001-of-00002.safetensors")
    (snapshot / "model-00002-of-00002.safetensors").write_bytes(b"second shard")
    (snapshot / "config.json").write_text('{"layers": 2}')
    assert fingerprint(str(snapshot), FileDigests(None)) == fingerprint(checkpoint(tmp_path / "m"),
                                                                        FileDigests(None))


def test_the_cost_measurement_runs_and_a_restart_reads_nothing(tmp_path):
    """bench/lab/weights_cost.py (the figures in docs/vllm.md), on a few MiB."""
    from bench.lab.weights_cost import measure

    result = measure(str(tmp_path / "ckpt"), shards=2, gib=1 / 256)
    assert result["bytes"] >= 2 * (4 << 20)
    assert result["cold_files_read"] == result["again_files_read"] == 3 and result["cached_files_read"] == 0
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "ckpt.digests.json").exists()
