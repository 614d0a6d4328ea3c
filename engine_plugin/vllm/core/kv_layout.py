"""The worker's view of an engine's paged KV: chunk bytes out of blocks and back in.

`group` is the engine's KV cache group whose blocks are meant (a hybrid model's groups
have layers and block tables of their own); a one-group layout has only group 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class KVLayout(Protocol):
    """How one worker's paged KV tensors turn into chunk bytes and back. `checks_copies`:
    `scatter` can verify a chunk's checksum in the same pass over its bytes as the copy."""

    chunk_bytes: int

    @property
    def checks_copies(self) -> bool: ...

    def gather(self, blocks: Sequence[int], out: memoryview, group: int = 0) -> None: ...

    def scatter(self, chunks: Sequence[tuple[memoryview | torch.Tensor, Sequence[int]]],
                group: int = 0, checks: Sequence[int | None] = ()) -> list[bool]:
        """Each (chunk's bytes, its block ids) into the blocks (SKIP ids left alone); where
        checks[i] is given (only where `checks_copies`), chunk i's bytes are verified as they
        are copied: False for one whose xxh3-64 is another (its blocks hold what was copied:
        the caller reports them failed, the engine recomputes them)."""
