"""glibc's streaming-store thresholds (kvstore/io/streaming.py): asked of the real dynamic
loader, and the environment a spawned process gets, whatever the engine's GLIBC_TUNABLES."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.io.streaming import (
    GLIBC_LEAST,
    REP_MOVSB,
    REP_MOVSB_ABOVE,
    TUNABLE,
    Thresholds,
    loader_thresholds,
    streaming_tunable,
    with_streaming,
)

ROOT = Path(__file__).resolve().parent.parent
PROBE = "from kvstore.io.streaming import streaming_thresholds; print(tuple(streaming_thresholds() or ()))"
PIECE = 256 << 10
REP = f"{REP_MOVSB}={REP_MOVSB_ABOVE:#x}"
GLIBC_DEFAULT_REP = 0x840  # glibc's own rep movsb threshold with AVX2 (2112 bytes)


def _thresholds_in_fresh_python(tunables: str | None) -> Thresholds | None:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    answer = ast.literal_eval(done.stdout.strip())  # a tuple of two ints, or ()
    return Thresholds(*answer) if answer else None


@pytest.fixture
def default_thresholds() -> Thresholds:
    """This machine's thresholds with nothing set, where they are glibc's on x86-64 and a put's
    piece would not stream under them."""
    thresholds = loader_thresholds("")
    if thresholds is None or streaming_tunable(PIECE, thresholds) is None:
        pytest.skip("not glibc on x86-64, or it streams 256 KiB copies already")
    return thresholds


def test_a_process_has_the_thresholds_it_started_with(default_thresholds) -> None:
    assert _thresholds_in_fresh_python(None) == default_thresholds
    assert _thresholds_in_fresh_python(f"{TUNABLE}=0x20000:{REP}") == Thresholds(0x20000, REP_MOVSB_ABOVE)


def test_copies_at_or_under_the_threshold_get_half_a_piece_and_glibc_takes_it() -> None:
    assert streaming_tunable(512 << 10, Thresholds(190316544, REP_MOVSB_ABOVE)) == f"{TUNABLE}=0x40000"
    equal = Thresholds(512 << 10, REP_MOVSB_ABOVE)  # equal: not on every CPU
    assert streaming_tunable(512 << 10, equal) == f"{TUNABLE}=0x40000"
    assert streaming_tunable(4096, Thresholds(1 << 20, REP_MOVSB_ABOVE)) == f"{TUNABLE}={GLIBC_LEAST:#x}"


def test_rep_movsb_below_any_l2_is_raised_over_it_whatever_the_streaming_threshold() -> None:
    """On AMD glibc takes `rep movsb` for copies up to the L2's size before it looks at the
    streaming threshold: a low streaming threshold alone left 512 KiB copies unstreamed."""
    assert streaming_tunable(512 << 10, Thresholds(0x20000, GLIBC_DEFAULT_REP)) == REP
    both_low = Thresholds(190316544, GLIBC_DEFAULT_REP)
    assert streaming_tunable(512 << 10, both_low) == f"{TUNABLE}=0x40000:{REP}"


def test_copies_that_stream_already_or_unknown_thresholds_get_nothing() -> None:
    assert streaming_tunable(512 << 10, Thresholds(0x20000, REP_MOVSB_ABOVE)) is None
    assert streaming_tunable(512 << 10, None) is None


def test_a_spawned_process_gets_the_entries_beside_the_engines_others(default_thresholds) -> None:
    wanted = streaming_tunable(PIECE, default_thresholds)
    assert with_streaming({"PATH": "/bin"}, PIECE) == {"PATH": "/bin", "GLIBC_TUNABLES": wanted}
    assert with_streaming({"GLIBC_TUNABLES": ""}, PIECE) == {"GLIBC_TUNABLES": wanted}
    assert with_streaming({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, PIECE) == {
        "GLIBC_TUNABLES": f"{wanted}:glibc.malloc.arena_max=2"}


def test_an_engines_thresholds_that_would_not_stream_the_pieces_are_replaced_others_kept(
        default_thresholds) -> None:
    """The engine's own setting (for its copies, e.g. 0x80000 for 512 KiB blocks, with glibc's
    `rep movsb`) would not stream a put's 256 KiB pieces: the spawned service gets entries
    that do; an engine's that stream them already are kept."""
    engine = {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{TUNABLE}=0x80000:{REP_MOVSB}=0x1000"}
    assert with_streaming(engine, PIECE) == {
        "GLIBC_TUNABLES": f"{TUNABLE}={PIECE // 2:#x}:{REP}:glibc.malloc.arena_max=2"}
    low = {"GLIBC_TUNABLES": f"{TUNABLE}=0x10000"}
    assert with_streaming(low, PIECE) == {"GLIBC_TUNABLES": f"{REP}:{TUNABLE}=0x10000"}
    both = {"GLIBC_TUNABLES": f"{TUNABLE}=0x10000:{REP}"}
    assert with_streaming(both, PIECE) == both


_TEXT = st.characters(codec="ascii", exclude_characters=":\0")
_ENTRY = st.one_of(
    st.builds(lambda v: f"{TUNABLE}={v}", st.sampled_from(["0x10000", "0x20000", "0x80000", "0", "zzz", ""])),
    st.builds(lambda v: f"{REP_MOVSB}={v}",
              st.sampled_from(["0x800", "0x100000", f"{REP_MOVSB_ABOVE:#x}", "x"])),
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
    given = loader_thresholds(tunables)
    wanted = streaming_tunable(PIECE, given)
    if wanted is None:
        assert env == {"GLIBC_TUNABLES": tunables}
        return
    result = env["GLIBC_TUNABLES"]
    thresholds = loader_thresholds(result)
    assert thresholds is not None and streaming_tunable(PIECE, thresholds) is None
    replaced = tuple(entry.split("=", 1)[0] + "=" for entry in wanted.split(":"))
    others = [e for e in tunables.split(":") if e and not e.startswith(replaced)]
    assert result.split(":")[len(replaced):] == others
