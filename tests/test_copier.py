"""Shared-out copies: every byte lands where it belongs, whatever the mix of sizes."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from kvstore.io.copier import copy_bytes, copy_many


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


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")
def test_a_caller_bound_to_one_cpu_shares_its_copies_only_onto_the_cpus_it_was_given(monkeypatch) -> None:
    """An engine worker bound to CPU 0 copies alone, unless its operator named CPUs it may
    also use (share_with): then helper threads on those take pieces of the copy."""
    import kvstore.io.copier as copier

    seen: list[tuple[int, frozenset[int]]] = []  # (thread, its CPUs) of each piece copied
    plain = copier.copy_bytes
    monkeypatch.setattr(copier, "copy_bytes", lambda dst, src: (
        seen.append((threading.get_ident(), frozenset(os.sched_getaffinity(0)))), plain(dst, src)))

    def bound_copy() -> int:
        """A 64 MiB copy from a thread bound to CPU 0, as vLLM binds its CPU worker."""
        caller: list[int] = []

        def run() -> None:
            os.sched_setaffinity(0, {0})
            caller.append(threading.get_ident())
            outs, sources = _pairs([64 << 20], 5)
            copy_many([(memoryview(outs[0]), memoryview(sources[0]))])
            assert np.array_equal(outs[0], sources[0])

        thread = threading.Thread(target=run)
        thread.start()
        thread.join(60)
        return caller[0]

    try:
        copier.share_with(())
        alone = bound_copy()
        assert seen and all(thread == alone for thread, _ in seen)
        seen.clear()
        copier.share_with({1})
        caller = bound_copy()
        helpers = {cpus for thread, cpus in seen if thread != caller}
        assert helpers and all(cpus == {0, 1} for cpus in helpers), seen
    finally:
        copier.share_with(())  # the next test's copies as they were
