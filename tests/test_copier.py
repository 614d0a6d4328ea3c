"""Shared-out copies: every byte lands where it belongs, whatever the mix of sizes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from kvstore.io.copier import (
    GLIBC_LEAST,
    copy_bytes,
    copy_many,
    streaming_threshold,
    streaming_tunable,
    with_streaming,
)

ROOT = Path(__file__).resolve().parent.parent


def _pairs(sizes: list[int], seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    sources = [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]
    return [np.zeros(size, np.uint8) for size in sizes], sources


@pytest.mark.parametrize("sizes", [
    [4096] * 3,                          # below the parallel threshold: the calling thread
    [256 << 10] * 40,                    # many small copies grouped into pieces
    [9 << 20, 4096, (4 << 20) + 12288],  # large copies split, odd tails
])
def test_copy_many_copies_every_byte(sizes: list[int]) -> None:
    outs, sources = _pairs(sizes, len(sizes))
    copy_many([(memoryview(o), memoryview(s)) for o, s in zip(outs, sources, strict=True)])
    for out, source in zip(outs, sources, strict=True):
        assert np.array_equal(out, source)


def test_copies_from_many_threads_at_once_stay_apart() -> None:
    """The service's client threads share the copy threads."""
    jobs = [_pairs([3 << 20, 1 << 20], seed) for seed in range(6)]

    def run(outs: list[np.ndarray], sources: list[np.ndarray]) -> None:
        copy_many([(memoryview(o), memoryview(s)) for o, s in zip(outs, sources, strict=True)])

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for outs, sources in jobs:
        for out, source in zip(outs, sources, strict=True):
            assert np.array_equal(out, source)


def test_a_length_mismatch_is_refused_before_any_byte_moves() -> None:
    outs, sources = _pairs([4 << 20, 4 << 20], 1)
    with pytest.raises(ValueError, match="copy of 4194304 bytes into 4190208"):
        copy_many([(memoryview(outs[0]), memoryview(sources[0])),
                   (memoryview(outs[1])[:-4096], memoryview(sources[1]))])
    assert not outs[0].any()
    with pytest.raises(ValueError):
        copy_bytes(memoryview(outs[0])[:1], memoryview(sources[0]))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: no helper threads")
def test_a_forked_child_copies_with_helpers_of_its_own() -> None:
    """A child forked after the pool started (a spawned engine worker) gets a pool of its
    own: its inherited copy has no threads."""
    outs, sources = _pairs([8 << 20], 3)
    copy_many([(memoryview(outs[0]), memoryview(sources[0]))])  # the parent's pool starts
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if its copy is whole and it had helpers
        outs[0][:] = 0
        copy_many([(memoryview(outs[0]), memoryview(sources[0]))])
        helpers = [t for t in threading.enumerate() if t.name.startswith("kvstore-copy")]
        os._exit(0 if np.array_equal(outs[0], sources[0]) and helpers else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


PROBE = "from kvstore.io.copier import streaming_threshold; print(streaming_threshold())"


def _threshold_in_fresh_python(tunables: str | None) -> int | None:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    answer = done.stdout.strip()
    return None if answer == "None" else int(answer)


def test_the_streaming_threshold_is_the_one_this_process_started_with() -> None:
    default = _threshold_in_fresh_python(None)
    if default is None:
        pytest.skip("not glibc on x86-64: its dynamic loader lists no streaming threshold")
    assert default > 0
    assert _threshold_in_fresh_python("glibc.cpu.x86_non_temporal_threshold=0x20000") == 0x20000


def test_copies_under_the_threshold_get_the_tunable_that_streams_them() -> None:
    assert streaming_tunable(512 << 10, 190316544) == "glibc.cpu.x86_non_temporal_threshold=0x80000"
    assert streaming_tunable(4096, 1 << 20) == f"glibc.cpu.x86_non_temporal_threshold={GLIBC_LEAST:#x}"


def test_copies_that_stream_already_or_an_unknown_threshold_get_no_tunable() -> None:
    assert streaming_tunable(512 << 10, 512 << 10) is None
    assert streaming_tunable(512 << 10, 0x20000) is None
    assert streaming_tunable(512 << 10, None) is None


def test_a_process_to_start_gets_the_tunable_beside_the_users_and_never_over_their_threshold() -> None:
    wanted = streaming_tunable(256 << 10, streaming_threshold())
    if wanted is None:
        pytest.skip("this glibc streams 256 KiB copies already, or is not glibc")
    assert with_streaming({"PATH": "/bin"}, 256 << 10) == {"PATH": "/bin", "GLIBC_TUNABLES": wanted}
    assert with_streaming({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, 256 << 10) == {
        "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{wanted}"}
    users = {"GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=0x1000000"}
    assert with_streaming(users, 256 << 10) == users
