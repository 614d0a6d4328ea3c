"""vLLM's paged KV tensors seen as [num_blocks, *per_block] whatever the backend.

Backends disagree on where the block axis sits: the CPU backend gives each layer
[num_blocks, kv_heads, block_size, 2*head_size], FlashAttention gives
[2, num_blocks, block_size, kv_heads, head_size], others differ again. Rather than
assume one, each layer's block axis is found by its size (the engine's block
count) and moved to the front as a view. A chunk's payload is, layer by layer in
name order, the chunk's blocks of that layer, each block as the backend stores it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from connectors.plan import SKIP
from kvstore.errors import ShapeError


def block_axis(name: str, tensor: torch.Tensor, num_blocks: int) -> int:
    """The axis of `tensor` that indexes blocks; ambiguous or absent is an error."""
    candidates = [axis for axis, size in enumerate(tensor.shape) if size == num_blocks]
    if len(candidates) > 1 and tensor.shape[0] == 2 and 1 in candidates:
        candidates = [1]  # [2 (K/V), num_blocks, ...]: the K/V split comes first
    if len(candidates) > 1 and 0 in candidates:
        candidates = [0]
    if len(candidates) != 1:
        raise ShapeError(f"KV cache of layer {name} has shape {tuple(tensor.shape)}: cannot find "
                         f"its block axis of size {num_blocks}")
    return candidates[0]


class PagedKVLayout:
    """gather/scatter chunk payloads from/to a worker's KV cache tensors."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int,
                 blocks_per_chunk: int) -> None:
        self.layers: list[torch.Tensor] = []
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for name in sorted(kv_caches):
            tensor = kv_caches[name]
            identity = (tensor.data_ptr(), tuple(tensor.shape))
            if identity in seen:
                continue  # layers sharing one KV tensor are stored once
            seen.add(identity)
            self.layers.append(tensor.movedim(block_axis(name, tensor, num_blocks), 0))
        if not self.layers:
            raise ShapeError("the engine registered no KV cache tensors")
        self.block_bytes = [layer[0].numel() * layer.element_size() for layer in self.layers]
        self.blocks_per_chunk = blocks_per_chunk
        self.chunk_bytes = blocks_per_chunk * sum(self.block_bytes)
        self.device = self.layers[0].device

    def describe(self) -> str:
        """Shapes and dtypes, for records' headers and error messages."""
        first = self.layers[0]
        return f"{len(self.layers)}x{tuple(first.shape[1:])}:{first.dtype}:{self.device.type}"

    def gather(self, blocks: Sequence[int], out: memoryview) -> None:
        """out[:] = the chunk's blocks of every layer (copy out of the engine)."""
        dest = torch.frombuffer(out, dtype=torch.uint8)
        index = torch.tensor(list(blocks), device=self.device)
        offset = 0
        for layer, block_bytes in zip(self.layers, self.block_bytes, strict=True):
            size = len(blocks) * block_bytes
            part = dest[offset : offset + size].view(layer.dtype).view(len(blocks), *layer.shape[1:])
            part.copy_(layer.index_select(0, index))
            offset += size

    def scatter(self, src: memoryview | torch.Tensor, blocks: Sequence[int]) -> None:
        """Write the chunk's bytes (host memory, or a uint8 tensor such as a device
        staging slot) into its blocks, leaving SKIP positions untouched."""
        source = src if isinstance(src, torch.Tensor) else torch.frombuffer(src, dtype=torch.uint8)
        if source.numel() != self.chunk_bytes or len(blocks) != self.blocks_per_chunk:
            raise ShapeError(f"chunk of {source.numel()} bytes / {len(blocks)} blocks does not fit "
                             f"{self.chunk_bytes} bytes / {self.blocks_per_chunk} blocks")
        keep = [i for i, block in enumerate(blocks) if block != SKIP]
        index = torch.tensor([blocks[i] for i in keep], device=self.device)
        positions = torch.tensor(keep, device=source.device)
        offset = 0
        for layer, block_bytes in zip(self.layers, self.block_bytes, strict=True):
            size = len(blocks) * block_bytes
            part = source[offset : offset + size].view(layer.dtype).view(len(blocks), *layer.shape[1:])
            layer.index_copy_(0, index, part.index_select(0, positions).to(self.device))
            offset += size
