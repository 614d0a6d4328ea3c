"""vLLM's paged KV tensors seen as [num_blocks, *per_block] whatever the backend.

Backends disagree on where the block axis sits: the CPU backend gives each layer
[num_blocks, kv_heads, block_size, 2*head_size], FlashAttention gives
[2, num_blocks, block_size, kv_heads, head_size], others differ again. Rather than
assume one, each layer's block axis is found by its size (the engine's block
count) and moved to the front as a view. A chunk's payload is, layer by layer in
name order, the chunk's blocks of that layer, each block as the backend stores it.

Copies go run by run: a chunk's blocks are mostly consecutive ids, and one slice copy
per run of them is a plain memcpy, where index_select + index_copy_ made a temporary
and copied twice. On the CPU engine a load's copies are byte ranges handed to
kvstore's copier (numpy memcpys that release the GIL, shared out across a few plain
threads that sleep when idle): a load from the DRAM tier is then one copy at the speed
of a threaded copy. torch's intra-op threads, on cores the engine's own threads already
busy-poll, made the same copy several times slower.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from engine_plugin.vllm.core.plan import SKIP
from kvstore.format.checksum import PIECE
from kvstore.format.errors import ShapeError
from kvstore.io.copier import copy_checked, copy_many

# A load from the mapped DRAM tier wraps read-only memory (PROT_READ) in a CPU tensor to
# copy it to the device: torch's warning that the tensor could write it is moot (the
# layout never writes a source, and a write would fault).
warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)


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


def block_runs(blocks: Sequence[int], descending: bool = False) -> list[tuple[slice, slice]]:
    """(positions in the chunk, block ids) as slices, for each run of consecutive block ids,
    SKIP positions left out. With `descending`, runs may also count down (vLLM hands out
    blocks freed by an earlier request in reverse order): slices with step -1, which
    numpy takes and torch does not."""
    runs: list[tuple[int, int, int, int]] = []  # position, first id, count, step
    for position, block in enumerate(blocks):
        if block == SKIP:
            continue
        if runs:
            start, first, count, step = runs[-1]
            follows = start + count == position
            if follows and count == 1 and descending and block == first - 1:
                runs[-1] = (start, first, 2, -1)
                continue
            if follows and block == first + step * count:
                runs[-1] = (start, first, count + 1, step)
                continue
        runs.append((position, block, 1, 1))
    return [(slice(start, start + count), _ids(first, count, step)) for start, first, count, step in runs]


def _ids(first: int, count: int, step: int) -> slice:
    if step == 1:
        return slice(first, first + count)
    end = first - count
    return slice(first, end if end >= 0 else None, -1)


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
            if tensor.stride(-1) != 1:
                raise ShapeError(f"KV cache of layer {name} has strides {tensor.stride()}: its last "
                                 f"axis must be contiguous")
            self.layers.append(tensor.movedim(block_axis(name, tensor, num_blocks), 0))
        if not self.layers:
            raise ShapeError("the engine registered no KV cache tensors")
        self.block_bytes = [layer[0].numel() * layer.element_size() for layer in self.layers]
        self.blocks_per_chunk = blocks_per_chunk
        self.chunk_bytes = blocks_per_chunk * sum(self.block_bytes)
        self.device = self.layers[0].device
        # Each layer as bytes, [num_blocks, ..., last axis x element size]: numpy arrays
        # sharing the tensors' memory on the CPU, torch views elsewhere.
        byte_views = [layer.view(torch.uint8) for layer in self.layers]
        self._on_host = self.device.type == "cpu"
        host: list[np.ndarray] = [v.numpy() for v in byte_views] if self._on_host else []
        self._targets: list[Any] = host if self._on_host else byte_views
        # Where the copier writes the layers directly, each one's bytes as one flat view:
        # a block's range is then a slice of it, with no array made per block.
        self._flat: list[memoryview] = [a.reshape(-1).data for a in host] if self.checks_copies else []

    def describe(self) -> str:
        """Shapes and dtypes, for records' headers and error messages."""
        first = self.layers[0]
        return f"{len(self.layers)}x{tuple(first.shape[1:])}:{first.dtype}:{self.device.type}"

    def gather(self, blocks: Sequence[int], out: memoryview, group: int = 0) -> None:
        """out[:] = the chunk's blocks of every layer (copy out of the engine); one group
        (engine_plugin/vllm/kv_groups.py holds one layout per group of a hybrid model)."""
        runs = block_runs(blocks, descending=self._on_host)
        for layer, part in zip(self._targets, self._parts(self._bytes(out), len(blocks)), strict=True):
            for positions, ids in runs:
                part[positions] = layer[ids]

    @property
    def smallest_copy(self) -> int:
        """The fewest bytes one copy of a load moves: one layer's block; where the copier
        hashes as it copies (a disk hit), copies are also cut at the hash's PIECE boundaries,
        and every range starts at a sum of blocks, so none is less than the greatest common
        divisor of PIECE and the blocks."""
        if self.checks_copies:
            return math.gcd(PIECE, *self.block_bytes)
        return min(self.block_bytes)

    @property
    def checks_copies(self) -> bool:
        """Host layers the copier writes directly: it can hash a chunk as it copies it."""
        return self._on_host and all(layer.flags.c_contiguous for layer in self._targets)

    def scatter(self, chunks: Sequence[tuple[memoryview | torch.Tensor, Sequence[int]]],
                group: int = 0, checks: Sequence[int | None] = ()) -> list[bool]:
        """Write each (chunk's bytes, its blocks) (host memory, or a uint8 tensor such as a
        device staging slot) into the blocks, leaving SKIP positions untouched. On the CPU
        engine all the chunks' byte ranges go to the copier in one call: one hand-off to
        its threads per wave, not one per chunk; a chunk with a check goes as one piece of
        work that hashes it as it copies it (KVLayout.scatter)."""
        pairs: list[tuple[memoryview, memoryview]] = []
        checked: list[tuple[memoryview, list[tuple[memoryview, int]]]] = []
        expected: list[int] = []
        direct = self.checks_copies
        for i, (src, blocks) in enumerate(chunks):
            source = self._bytes(src)
            if len(source) != self.chunk_bytes or len(blocks) != self.blocks_per_chunk:
                raise ShapeError(f"chunk of {len(source)} bytes / {len(blocks)} blocks does not fit "
                                 f"{self.chunk_bytes} bytes / {self.blocks_per_chunk} blocks")
            check = checks[i] if i < len(checks) else None
            if check is not None and not direct:
                raise ShapeError("this layout cannot check a chunk as it copies it (checks_copies)")
            runs = block_runs(blocks, descending=self._on_host)
            if not direct:
                for layer, part in zip(self._targets, self._parts(source, len(blocks)), strict=True):
                    for positions, ids in runs:
                        layer[ids] = part[positions]
                continue
            view, ranges = source.data, self._ranges(runs)
            if check is None:
                pairs += [(dst, view[at : at + len(dst)]) for dst, at in ranges]
            else:
                checked.append((view, ranges))
                expected.append(check)
        if pairs:
            copy_many(pairs)
        verdicts = iter([found == want for found, want in zip(copy_checked(checked), expected, strict=True)])
        return [True if (checks[i] if i < len(checks) else None) is None else next(verdicts)
                for i in range(len(chunks))]

    def _ranges(self, runs: Sequence[tuple[slice, slice]]) -> list[tuple[memoryview, int]]:
        """(destination bytes, the offset in the chunk of what goes there) of each copy of a
        chunk into the flat layers: one per layer for a run counting up, one per layer and
        block for a run counting down."""
        ranges: list[tuple[memoryview, int]] = []
        base = 0
        for layer, size in zip(self._flat, self.block_bytes, strict=True):
            for positions, ids in runs:
                at = base + positions.start * size
                if ids.step == -1:
                    down = range(ids.start, -1 if ids.stop is None else ids.stop, -1)
                    ranges += [(layer[block * size : (block + 1) * size], at + n * size)
                               for n, block in enumerate(down)]
                else:
                    ranges.append((layer[ids.start * size : ids.stop * size], at))
            base += self.blocks_per_chunk * size
        return ranges

    def _bytes(self, buffer: memoryview | torch.Tensor) -> Any:
        """A chunk buffer as a flat uint8 array of the kind the layers are (numpy or torch)."""
        if isinstance(buffer, torch.Tensor):
            return buffer.numpy() if self._on_host else buffer
        return np.frombuffer(buffer, dtype=np.uint8) if self._on_host else torch.frombuffer(
            buffer, dtype=torch.uint8)

    def _parts(self, chunk: Any, num_blocks: int) -> list[Any]:
        """The chunk's bytes split per layer, each shaped [num_blocks, *that layer's block]."""
        parts, offset = [], 0
        for layer, block_bytes in zip(self._targets, self.block_bytes, strict=True):
            size = num_blocks * block_bytes
            parts.append(chunk[offset : offset + size].reshape(num_blocks, *layer.shape[1:]))
            offset += size
        return parts

