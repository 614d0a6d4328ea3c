"""The CPU worker's advice on streaming copies (engine_plugin/vllm/cpu_copies.py): given
only where a load's copies would not stream, naming a threshold glibc takes."""

from __future__ import annotations

from engine_plugin.vllm.cpu_copies import GLIBC_LEAST, streaming_advice


def test_copies_under_the_threshold_get_the_tunable_that_streams_them() -> None:
    advice = streaming_advice(512 << 10, 190316544)
    assert advice is not None
    assert "GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x80000 " in advice


def test_copies_that_stream_already_or_an_unknown_threshold_get_no_advice() -> None:
    assert streaming_advice(512 << 10, 512 << 10) is None
    assert streaming_advice(512 << 10, 0x20000) is None
    assert streaming_advice(512 << 10, None) is None


def test_a_block_smaller_than_glibc_takes_is_advised_glibcs_least() -> None:
    advice = streaming_advice(4096, 1 << 20)
    assert advice is not None and f"x86_non_temporal_threshold={GLIBC_LEAST:#x} " in advice
