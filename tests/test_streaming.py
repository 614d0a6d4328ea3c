"""glibc's streaming-store threshold (kvstore/io/streaming.py): asked of the real dynamic
loader, and the environment a spawned process gets, whatever the engine's GLIBC_TUNABLES."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.io.streaming import GLIBC_LEAST, TUNABLE, loader_threshold, streaming_tunable, with_streaming

ROOT = Path(__file__).resolve().parent.parent
PROBE = "from kvstore.io.streaming import streaming_threshold; print(streaming_threshold())"
PIECE = 256 << 10


def _threshold_in_fresh_python(tunables: str | None) -> int | None:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    answer = done.stdout.strip()
    return None if answer == "None" else int(answer)


@pytest.fixture
def default_threshold() -> int:
    """This machine's threshold with nothing set, where it is glibc's on x86-64 and above a put's piece."""
    threshold = loader_threshold("")
    if threshold is None or threshold < PIECE:
        pytest.skip("not glibc on x86-64, or it streams 256 KiB copies already")
    return threshold


def test_a_process_has_the_threshold_it_started_with(default_threshold) -> None:
    assert _threshold_in_fresh_python(None) == default_threshold
    assert _threshold_in_fresh_python(f"{TUNABLE}=0x20000") == 0x20000


def test_copies_at_or_under_the_threshold_get_half_a_piece_and_glibc_takes_it() -> None:
    assert streaming_tunable(512 << 10, 190316544) == f"{TUNABLE}=0x40000"
    assert streaming_tunable(512 << 10, 512 << 10) == f"{TUNABLE}=0x40000"  # equal: not on every CPU
    assert streaming_tunable(4096, 1 << 20) == f"{TUNABLE}={GLIBC_LEAST:#x}"


def test_copies_over_the_threshold_or_an_unknown_one_get_nothing() -> None:
    assert streaming_tunable(512 << 10, 0x20000) is None
    assert streaming_tunable(512 << 10, None) is None


def test_a_spawned_process_gets_the_entry_beside_the_engines_others(default_threshold) -> None:
    wanted = f"{TUNABLE}={PIECE // 2:#x}"
    assert with_streaming({"PATH": "/bin"}, PIECE) == {"PATH": "/bin", "GLIBC_TUNABLES": wanted}
    assert with_streaming({"GLIBC_TUNABLES": ""}, PIECE) == {"GLIBC_TUNABLES": wanted}
    assert with_streaming({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, PIECE) == {
        "GLIBC_TUNABLES": f"{wanted}:glibc.malloc.arena_max=2"}


def test_an_engines_threshold_too_high_for_the_pieces_is_replaced_a_low_one_kept(default_threshold) -> None:
    """The engine's own setting (for its copies, e.g. 0x80000 for 512 KiB blocks) would not
    stream a put's 256 KiB pieces: the spawned service gets one that does."""
    engine = {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{TUNABLE}=0x80000"}
    assert with_streaming(engine, PIECE) == {
        "GLIBC_TUNABLES": f"{TUNABLE}={PIECE // 2:#x}:glibc.malloc.arena_max=2"}
    low = {"GLIBC_TUNABLES": f"{TUNABLE}=0x10000"}
    assert with_streaming(low, PIECE) == low


_TEXT = st.characters(codec="ascii", exclude_characters=":\0")
_ENTRY = st.one_of(
    st.builds(lambda v: f"{TUNABLE}={v}", st.sampled_from(["0x10000", "0x20000", "0x80000", "0", "zzz", ""])),
    st.builds(lambda n, v: f"glibc.{n}={v}", st.sampled_from(["malloc.arena_max", "cpu.hwcaps"]),
              st.text(_TEXT, max_size=12)),
    st.text(_TEXT, max_size=20))


@settings(max_examples=60, deadline=None)
@given(st.lists(_ENTRY, max_size=5).map(":".join))
def test_whatever_the_engine_set_the_service_gets_a_streaming_threshold_and_the_rest(tunables: str) -> None:
    """Any GLIBC_TUNABLES an engine may have (an environment holds no NUL): the spawned
    process's copies of a piece stream under the entries it gets, and the engine's other
    entries reach it in their order."""
    env = with_streaming({"GLIBC_TUNABLES": tunables}, PIECE)
    given_threshold = loader_threshold(tunables)
    if given_threshold is None or given_threshold < PIECE:
        assert env == {"GLIBC_TUNABLES": tunables}
        return
    result = env["GLIBC_TUNABLES"]
    threshold = loader_threshold(result)
    assert threshold is not None and threshold < PIECE
    others = [e for e in tunables.split(":") if e and not e.startswith(TUNABLE + "=")]
    assert result.split(":")[1:] == others
