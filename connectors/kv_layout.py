"""The worker's view of an engine's paged KV: chunk bytes out of blocks and back in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class KVLayout(Protocol):
    """How one worker's paged KV tensors turn into chunk bytes and back."""

    chunk_bytes: int

    def gather(self, blocks: Sequence[int], out: memoryview) -> None: ...

    def scatter(self, src: memoryview | torch.Tensor, blocks: Sequence[int]) -> None: ...
