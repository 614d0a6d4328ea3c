"""Paged KV layouts: the block axis is found, never assumed; gather/scatter round trip."""

from __future__ import annotations

import mmap

import pytest
import torch

from engine_plugin.vllm.core.plan import SKIP
from engine_plugin.vllm.layout import PagedKVLayout, block_axis, block_runs
from kvstore.format.errors import ShapeError

NUM_BLOCKS = 10


def layouts() -> dict[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    return {
        # CPU backend: [num_blocks, kv_heads, block_size, 2 * head_size]
        "cpu": {f"layers.{i}": torch.randn(NUM_BLOCKS, 2, 16, 64).half() for i in range(3)},
        # FlashAttention: [2, num_blocks, block_size, kv_heads, head_size]
        "flash": {f"layers.{i}": torch.randn(2, NUM_BLOCKS, 16, 2, 32).bfloat16() for i in range(3)},
    }


@pytest.mark.parametrize("name", ["cpu", "flash"])
def test_gather_then_scatter_moves_exactly_the_chunk_blocks(name):
    caches = layouts()[name]
    layout = PagedKVLayout(caches, NUM_BLOCKS, blocks_per_chunk=2)
    window = memoryview(mmap.mmap(-1, layout.chunk_bytes))
    layout.gather([3, 7], window)
    before = {key: tensor.clone() for key, tensor in caches.items()}
    layout.scatter([(window, [SKIP, 1])])  # block 7's bytes land in block 1; block 3's are skipped
    axis = 0 if name == "cpu" else 1
    for key, tensor in caches.items():
        moved, original = tensor.movedim(axis, 0), before[key].movedim(axis, 0)
        assert torch.equal(moved[1], original[7])
        untouched = [b for b in range(NUM_BLOCKS) if b != 1]
        assert torch.equal(moved[untouched], original[untouched])


def test_layers_sharing_one_tensor_are_stored_once():
    shared = torch.zeros(NUM_BLOCKS, 2, 16, 64)
    layout = PagedKVLayout({"a": shared, "b": shared}, NUM_BLOCKS, blocks_per_chunk=1)
    assert layout.chunk_bytes == shared[0].numel() * shared.element_size()


def test_a_missing_block_axis_is_an_error_naming_the_layer():
    with pytest.raises(ShapeError, match=r"layer attn\.3 .* block axis of size 10"):
        block_axis("attn.3", torch.zeros(4, 5, 6), NUM_BLOCKS)
    assert block_axis("kv", torch.zeros(2, NUM_BLOCKS, NUM_BLOCKS, 4), NUM_BLOCKS) == 1


def test_scatter_refuses_a_chunk_of_the_wrong_size():
    layout = PagedKVLayout(layouts()["cpu"], NUM_BLOCKS, blocks_per_chunk=2)
    with pytest.raises(ShapeError, match="does not fit"):
        layout.scatter([(memoryview(bytearray(layout.chunk_bytes - 2)), [1, 2])])


def test_runs_of_blocks_copy_as_slices_in_either_direction():
    assert block_runs([4, 5, SKIP, 9, 8], descending=True) == [
        (slice(0, 2), slice(4, 6)), (slice(3, 5), slice(9, 7, -1))]
    assert block_runs([1, 0], descending=True) == [(slice(0, 2), slice(1, None, -1))]
    assert block_runs([1, 0]) == [(slice(0, 1), slice(1, 2)), (slice(1, 2), slice(0, 1))]  # torch: no step -1
    caches = layouts()["cpu"]
    layout = PagedKVLayout(caches, NUM_BLOCKS, blocks_per_chunk=4)
    window = memoryview(mmap.mmap(-1, layout.chunk_bytes))
    before = {key: tensor.clone() for key, tensor in caches.items()}
    layout.gather([9, 8, 7, 6], window)  # blocks freed by an earlier request come back reversed
    layout.scatter([(window, [2, 3, SKIP, 0])])
    for key, tensor in caches.items():
        assert torch.equal(tensor[[2, 3, 0]], before[key][[9, 8, 6]])
        assert torch.equal(tensor[[1, 4, 5, 6, 7, 8, 9]], before[key][[1, 4, 5, 6, 7, 8, 9]])


@pytest.mark.parametrize(("block_elements", "smallest"),
                         [(2048, 64 << 10), (4096, 128 << 10), (8192, 256 << 10)])
def test_a_checked_load_copies_no_piece_smaller_than_the_smallest_copy_it_names(monkeypatch, block_elements,
                                                                                smallest):
    """What the worker's streaming advice is sized by (worker_role.py): a disk hit's copies
    are cut at the hash's piece boundaries as well as at blocks, so a 192 KiB block gives
    64 KiB copies, not 192 KiB ones."""
    import ctypes

    import xxhash

    caches = {f"layers.{i}": torch.zeros(NUM_BLOCKS, 3, 16, block_elements, dtype=torch.float16)
              for i in range(3)}
    layout = PagedKVLayout(caches, NUM_BLOCKS, blocks_per_chunk=2)
    assert layout.checks_copies and layout.smallest_copy == smallest
    chunk = torch.randint(0, 256, (layout.chunk_bytes,), dtype=torch.uint8)
    sizes: list[int] = []
    memmove = ctypes.memmove
    monkeypatch.setattr(ctypes, "memmove", lambda dst, src, n: sizes.append(n) or memmove(dst, src, n))
    check = xxhash.xxh3_64_intdigest(chunk.numpy())
    assert layout.scatter([(memoryview(chunk.numpy()), [7, 4])], checks=[check])
    assert min(sizes) == smallest  # blocks apart: each block's range is its own copy
    window = memoryview(mmap.mmap(-1, layout.chunk_bytes))
    layout.gather([7, 4], window)
    assert bytes(window) == chunk.numpy().tobytes()


@pytest.mark.parametrize("checked", [False, True])
def test_scatter_puts_every_block_of_every_layer_where_gather_found_it(checked):
    """Runs up, runs down, single blocks and skipped positions, in layers of different
    block sizes: each copy's source offset is computed, not looked up, so every layer's
    base and every position within a run must come out right."""
    import xxhash

    torch.manual_seed(1)
    caches = {"a": torch.randn(NUM_BLOCKS, 2, 16, 64).half(), "b": torch.randn(NUM_BLOCKS, 1, 16, 32).half(),
              "c": torch.randn(NUM_BLOCKS, 4, 16, 16).half()}
    layout = PagedKVLayout(caches, NUM_BLOCKS, blocks_per_chunk=6)
    window = memoryview(mmap.mmap(-1, layout.chunk_bytes))
    source = [0, 1, 2, 3, 4, 5]
    layout.gather(source, window)
    check = xxhash.xxh3_64_intdigest(bytes(window)) if checked else None
    before = {key: tensor.clone() for key, tensor in caches.items()}
    target = [9, 8, SKIP, 6, 7, 1]  # down, skipped, up, alone
    assert layout.scatter([(window, target)], checks=[check]) == [True]
    for key, tensor in caches.items():
        for position, block in enumerate(target):
            if block != SKIP:
                assert torch.equal(tensor[block], before[key][source[position]]), (key, position)
        assert torch.equal(tensor[[0, 2, 3, 4, 5]], before[key][[0, 2, 3, 4, 5]])
