"""The weights' fingerprint in every namespace: what it covers, its cache, and generations."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connectors.weights import (
    FileDigests,
    WeightsUnknown,
    checkpoint_files,
    default_digests,
    fingerprint,
    numerics,
    overrides_digest,
)


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
    assert a.startswith("sha256:") and len(a) == 7 + 64
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
    restarted = FileDigests(cache)  # a new process: the cache file
    assert fingerprint(model, restarted) == first and restarted.hashed == 0
    shard = tmp_path / "m" / "model-00001-of-00002.safetensors"
    os.utime(shard, ns=(os.stat(shard).st_atime_ns, os.stat(shard).st_mtime_ns + 1))
    again = FileDigests(cache)
    assert fingerprint(model, again) == first and again.hashed == 1  # its stamp moved: read again


@pytest.mark.skipif(shutil.which("cp") is None, reason="needs cp")
def test_new_weights_of_the_same_size_copied_over_with_their_times_are_hashed_again(tmp_path):
    """A release deployed in place with `cp -p` (or `rsync -a --inplace`): the same files,
    sizes and mtimes, other bytes. Device, inode, size and mtime all match the old weights';
    only the ctime (which no call but the kernel's sets) tells the cache they changed."""
    model = checkpoint(tmp_path / "m")
    cache = str(tmp_path / "cache.json")
    old = fingerprint(model, FileDigests(cache))
    release = checkpoint(tmp_path / "release", weights=b"v" * 1000)  # a fine-tune: same sizes
    shard = "model-00001-of-00002.safetensors"
    times = os.stat(tmp_path / "m" / shard)
    os.utime(tmp_path / "release" / shard, ns=(times.st_atime_ns, times.st_mtime_ns))  # normalised times
    inode = times.st_ino
    subprocess.run(["cp", "-p", str(tmp_path / "release" / shard), str(tmp_path / "m" / shard)], check=True)
    now = os.stat(tmp_path / "m" / shard)
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (inode, times.st_size, times.st_mtime_ns)
    deployed = fingerprint(model, FileDigests(cache))  # the next engine start
    assert deployed != old
    assert deployed == fingerprint(release, FileDigests(None))


ODD_ENTRIES = {
    "a digest that is not hex": lambda e: [*e[:5], "zz" * 32],
    "a short digest": lambda e: [*e[:5], "ab"],
    "an older version's (four stamps, an xxh3)": lambda e: [*e[:4], "ab" * 16],
    "a stamp that is not an integer": lambda e: [*e[:4], "x", e[5]],
    "a digest that is not text": lambda e: [*e[:5], 6],
    "not a list": lambda e: "entry",
    "null": lambda e: None,
}


@pytest.mark.parametrize("odd", ODD_ENTRIES.values(), ids=ODD_ENTRIES.keys())
def test_an_odd_cache_entry_counts_as_absent(tmp_path, odd):
    """An entry of another version or a damaged one is never used, and never fails the
    fingerprint (the engine's start)."""
    model = checkpoint(tmp_path / "m")
    cache = tmp_path / "cache.json"
    fingerprint(model, FileDigests(str(cache)))
    known = json.loads(cache.read_text())
    name = next(iter(known))
    cache.write_text(json.dumps({**known, name: odd(known[name])}))
    digests = FileDigests(str(cache))
    assert fingerprint(model, digests) == fingerprint(model, FileDigests(None))
    assert digests.hashed == 1


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a": "' + "x" * (8 << 20) + '"}'])
def test_a_nested_or_huge_cache_file_is_an_empty_cache(tmp_path, text):
    model = checkpoint(tmp_path / "m")
    cache = tmp_path / "cache.json"
    cache.write_text(text)
    digests = FileDigests(str(cache))
    assert fingerprint(model, digests) == fingerprint(model, FileDigests(None)) and digests.hashed == 3


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
    assert fingerprint(model, default_digests()).startswith("sha256:")  # a link is never followed
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


_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(overrides=_JSON | st.text(max_size=64) | st.binary(max_size=16))
def test_any_override_is_named_or_none_never_an_error(overrides):
    """What an operator may write as config overrides (`--hf-overrides`,
    `--json-model-override-args`): any value or text gives a short digest or, for none,
    nothing; the same content spelled otherwise (its JSON re-spaced, keys reordered) gives
    the same digest."""
    named = overrides_digest(overrides)
    assert named is None or (len(named) == 32 and set(named) <= set("0123456789abcdef"))
    if isinstance(overrides, (dict, list)) and overrides:
        assert named is not None
        assert overrides_digest(json.dumps(overrides, indent=3, sort_keys=False)) == named
    if not overrides:
        assert named is None
    assert numerics(quant=None, overrides=named) == (f"|overrides:{named}" if named else "")
