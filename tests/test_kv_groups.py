"""A hybrid model's KV cache groups in the connector core: what each group loads, saves and
needs for a hit (engine_plugin/vllm/core/groups.py), and the engine's groups as the plugin reads them."""

from __future__ import annotations

import pytest

from engine_plugin.vllm.core.groups import GroupRules, KVGeometry, KVGroup
from engine_plugin.vllm.core.plan import SKIP
from engine_plugin.vllm.core.prefetch import Residency
from engine_plugin.vllm.core.scheduler_side import SchedulerCore, SchedulerSettings
from kvstore.format.keys import KVNamespace, Shard, chunk_keys

CHUNK, BLOCK, WINDOW = 256, 128, 256
FULL = KVGroup(2, "full_attention", "2:full")
SLIDING = KVGroup(0, "sliding_window", "0:sliding", WINDOW)
PROMPT = list(range(3, 3 + 2049))  # 8 full chunks and one token to compute


def rules(interval: int = 0) -> GroupRules:
    return GroupRules((FULL, SLIDING), CHUNK, BLOCK, interval)


def namespaces(salt: str) -> tuple[KVNamespace, ...]:
    return tuple(KVNamespace("m", "float16", "cpu", CHUNK, Shard(group=g.signature), salt=salt)
                 for g in (FULL, SLIDING))


def keys_of(group: int, tokens: list[int] = PROMPT) -> list[bytes]:
    return chunk_keys(tokens, namespaces("")[group])


def core(present: set[bytes], interval: int = 0) -> SchedulerCore:
    def lookup(lists: list[list[bytes]], prefetch: bool, lease: bool = False) -> Residency:
        count = min(next((i for i, key in enumerate(keys) if key not in present), len(keys))
                    for keys in lists)
        return Residency(count, count)

    return SchedulerCore(KVGeometry(CHUNK, BLOCK, rules(interval)), namespaces, lookup, SchedulerSettings())


def test_a_sliding_group_needs_only_the_blocks_vllm_keeps_before_the_boundary():
    # vLLM keeps blocks from (b - window + 1) // block_size: at 2048 that is block 14, chunk 7.
    assert rules().first_needed(SLIDING, 8) == 7
    assert rules().first_needed(SLIDING, 1) == 0
    assert rules().first_needed(FULL, 8) == 0
    wide = KVGroup(1, "sliding_window", "1:sliding", 1024)
    assert rules().first_needed(wide, 8) == 4  # 2048 - 1023 = 1025 -> block 8 -> chunk 4


def test_a_sliding_group_keeps_the_windows_before_the_prompt_end_the_interval_and_answers():
    assert [c for c in range(9) if rules().keeps(SLIDING, c, 2049)] == [7, 8]
    # A prompt of exactly 8 chunks: a resend hits at chunk 7, a continuation at chunk 8.
    assert [c for c in range(8) if rules().keeps(SLIDING, c, 2048)] == [6, 7]
    assert [c for c in range(8) if rules(interval=1024).keeps(SLIDING, c, 2049)] == [3, 7]
    assert all(rules().keeps(FULL, c, 2049) for c in range(8))


def test_a_hit_needs_every_group_and_falls_back_to_an_interval_boundary():
    full, sliding = keys_of(0), keys_of(1)
    assert core(set(full)).num_new_matched_tokens("a", PROMPT, 0) == 0  # no sliding window stored
    assert core(set(full) | {sliding[7]}).num_new_matched_tokens("b", PROMPT, 0) == 2048
    assert core(set(full[:7]) | {sliding[7]}).num_new_matched_tokens("c", PROMPT, 0) == 0
    # The full run reaches 8 chunks but the window before it is gone: the interval boundary 4 holds.
    assert core(set(full) | {sliding[3]}, interval=1024).num_new_matched_tokens("d", PROMPT, 0) == 1024


def test_loads_skip_null_blocks_and_chunks_outside_the_window():
    scheduler = core(set(keys_of(0)) | {keys_of(1)[7]})
    assert scheduler.num_new_matched_tokens("r", PROMPT, 0) == 2048
    full_blocks = list(range(100, 117))
    sliding_blocks = [0] * 14 + [214, 215, 216]  # vLLM's null block where it keeps nothing
    scheduler.on_alloc("r", _by_index(full_blocks, sliding_blocks), 2048)
    by_group = {load.group: load for load in scheduler.take_plan().loads}
    assert by_group[FULL.index].blocks == tuple(zip(full_blocks[:16:2], full_blocks[1:16:2], strict=True))
    assert by_group[SLIDING.index].blocks == ((214, 215),)
    assert by_group[SLIDING.index].keys == ((keys_of(1)[7],),)
    assert all(SKIP not in ids and 0 not in ids for load in by_group.values() for ids in load.blocks)


def test_saves_store_each_groups_chunks_never_a_null_block():
    scheduler = core(set())
    assert scheduler.num_new_matched_tokens("r", PROMPT, 0) == 0
    sliding = [0] * 12 + list(range(212, 217))  # chunks 0-5 already dropped by vLLM
    scheduler.on_scheduled("r", _by_index(list(range(100, 117)), sliding), True, 2049)
    saves = {save.group: save for save in scheduler.take_plan().saves}
    assert len(saves[FULL.index].blocks) == 8
    assert saves[SLIDING.index].keys == ((keys_of(1)[7],),)  # chunk 6 is not needed, 7 is
    assert saves[SLIDING.index].blocks == ((214, 215),)
    dropped = core(set())
    dropped.num_new_matched_tokens("r", PROMPT, 0)
    dropped.on_scheduled("r", _by_index(list(range(100, 117)), [0] * 17), True, 2049)
    assert [save.group for save in dropped.take_plan().saves] == [FULL.index]


def _by_index(full: list[int], sliding: list[int]) -> tuple[list[int], ...]:
    """vLLM's block ids per group index: sliding is group 0, full group 2 (group 1 unused here)."""
    return (sliding, [], full)


def test_the_engines_groups_full_attention_first_and_unsupported_kinds_refused():
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    from engine_plugin.vllm.kv_groups import group_rules, kv_groups
    from engine_plugin.vllm.kv_spec import UnsupportedKVCache

    full = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float16)
    window = SlidingWindowSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float16,
                               sliding_window=256)
    one = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], full)])
    assert group_rules(one, CHUNK, BLOCK, 0) is None  # one group: stored as before, same keys
    hybrid = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["l0"], window), KVCacheGroupSpec(["l1"], window), KVCacheGroupSpec(["l2"], full)])
    groups = kv_groups(hybrid)
    assert [(g.index, g.kind, g.sliding_window) for g in groups] == [
        (2, "full_attention", None), (0, "sliding_window", 256), (1, "sliding_window", 256)]
    assert len({g.signature for g in groups}) == 3
    mamba = MambaSpec(block_size=128, shapes=((4, 4),), dtypes=(torch.float16,))
    with pytest.raises(UnsupportedKVCache, match=r"group 1 is mamba"):
        kv_groups(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["l0"], full), KVCacheGroupSpec(["m0"], mamba)]))
