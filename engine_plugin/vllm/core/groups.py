"""KV cache groups of a hybrid model: which chunks each group stores, loads and needs for a hit.

vLLM's hybrid KV cache manager keeps one block table per group. A full-attention group
keeps every block of a request. A sliding-window group keeps only the blocks inside the
window before the next token to compute: the others are vLLM's null block (id 0), its
scratch block, never real KV. So, per group, with chunk boundary b (a hit ends there):

- full attention: chunks [0, b) are needed, loaded and stored, as for a one-group model;
- sliding window: only the chunks holding the blocks vLLM keeps at b are needed and
  loaded (`first_needed`); a chunk is stored only if a later hit can use it, i.e. it lies
  in the window before a boundary a hit can end on: the prompt's end, each chunk of an
  answer (the next turn of a conversation starts there), and every `interval` tokens
  (prompts that share a prefix and then differ). A chunk holding a null block is never
  stored.

A hit needs every group: the full groups' leading run, and each sliding group's window
before the boundary, which is looked for at the run's end, then at the interval
boundaries below it (a few tries).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine_plugin.vllm.core.plan import SKIP
from engine_plugin.vllm.core.prefetch import Lookup, Residency

NULL_BLOCK = 0  # vLLM's null block: the id a group's table holds where it keeps no KV
MAX_HIT_TRIES = 4  # boundaries tried for the sliding groups' windows, per lookup



@dataclass(frozen=True)
class KVGroup:
    """One KV cache group as the connector stores it."""

    index: int  # vLLM's group index (block ids come per group, in this order)
    kind: str  # "full_attention" or "sliding_window"
    signature: str  # index, kind and geometry: enters the chunk keys
    sliding_window: int | None = None  # tokens, for a sliding-window group

    @property
    def windowed(self) -> bool:
        return self.sliding_window is not None


@dataclass(frozen=True)
class GroupRules:
    """What each group stores and needs; `groups` lists full-attention groups first."""

    groups: tuple[KVGroup, ...]
    chunk_tokens: int
    block_size: int
    interval: int  # tokens between boundaries whose windows are always stored

    @property
    def step(self) -> int:
        """Chunks between interval boundaries (0: none)."""
        return self.interval // self.chunk_tokens

    def first_needed(self, group: KVGroup, boundary_chunks: int) -> int:
        """The first chunk a hit ending at chunk `boundary_chunks` needs from `group`:
        vLLM keeps blocks from (b - window + 1) // block_size on (single_type_kv_cache_manager)."""
        if group.sliding_window is None:
            return 0
        skipped = max(0, boundary_chunks * self.chunk_tokens - group.sliding_window + 1)
        return (skipped // self.block_size) * self.block_size // self.chunk_tokens

    def keeps(self, group: KVGroup, chunk: int, prompt_tokens: int) -> bool:
        """Whether chunk `chunk` of `group` is worth storing: some boundary a later hit can
        end on needs it."""
        if group.sliding_window is None:
            return True
        prompt_end = prompt_tokens // self.chunk_tokens
        if chunk >= prompt_end:  # an answer chunk: the next turn's hit ends at or after it
            return True
        boundaries = {prompt_end, (prompt_tokens - 1) // self.chunk_tokens}
        if self.step:
            boundaries.update(range(self.step, prompt_end + 1, self.step))
        reach = -(-group.sliding_window // self.chunk_tokens) + 1  # chunks a window can span
        return any(b > chunk and b - chunk <= reach and self.first_needed(group, b) <= chunk
                   for b in boundaries)

    def candidates(self, run: int) -> list[int]:
        """Boundaries (in chunks) a hit may end on, longest first: the run's end, then the
        interval boundaries below it."""
        found = [run, *(range(run // self.step * self.step, 0, -self.step) if self.step else ())]
        unique = list(dict.fromkeys(b for b in found if b > 0))
        return unique[:MAX_HIT_TRIES]

    def hit(self, lookup: Lookup, keys: Sequence[Sequence[Sequence[bytes]]], cap: int,
            prefetch: bool) -> Residency:
        """Chunks of a prompt every group holds, at most `cap`; keys[group][rank][chunk],
        groups in `self.groups` order."""
        full = [list(k[:cap]) for g, ks in zip(self.groups, keys, strict=True) if not g.windowed for k in ks]
        run = lookup(full, prefetch) if full and cap > 0 else Residency(cap, cap)
        resident, pending = run.resident, run.pending
        for boundary in self.candidates(min(run.stored, cap)):
            complete = True
            for group, group_keys in zip(self.groups, keys, strict=True):
                if not group.windowed:
                    continue
                first = self.first_needed(group, boundary)
                window = lookup([list(k[first:boundary]) for k in group_keys], prefetch)
                pending = pending or window.pending
                if window.stored < boundary - first:
                    complete = False
                    break
                if window.resident < boundary - first:
                    resident = min(resident, first)
            if complete:
                return Residency(boundary, min(resident, boundary), pending)
        return Residency(0, 0, pending)


@dataclass(frozen=True)
class KVGeometry:
    """The engine's paged KV cache as the scheduler plans over it: tokens per chunk (the
    store's), tokens per block (the engine's; a chunk is whole blocks), and a hybrid
    model's groups (`rules`; None: one full-attention group). Fixed by the model and the
    store, never by an option."""

    chunk_tokens: int
    block_size: int
    rules: GroupRules | None = None

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        """Every group the engine keeps blocks for, in `rules`' order (full attention first)."""
        return self.rules.groups if self.rules is not None else (KVGroup(0, "full_attention", ""),)


def loadable(group: KVGroup, blocks: Sequence[int], skip: int) -> tuple[int, ...]:
    """A chunk's block ids for a load into `group`: blocks vLLM keeps none of (null) are
    `skip`, never written."""
    if not group.windowed:
        return tuple(blocks)
    return tuple(skip if b == NULL_BLOCK else b for b in blocks)


def storable(group: KVGroup, blocks: Sequence[int]) -> bool:
    """A chunk can be stored only if every block holds KV (no null or scratch block)."""
    return not group.windowed or NULL_BLOCK not in blocks


def per_group(block_ids: Sequence[int] | Sequence[Sequence[int]]) -> list[list[int]]:
    """Block ids per group, from vLLM's tuple of lists (or one group's flat list)."""
    if not block_ids or isinstance(block_ids[0], int):
        return [[int(b) for b in block_ids]]  # type: ignore[arg-type]
    return [list(ids) for ids in block_ids]  # type: ignore[arg-type]


def save_runs(rules: GroupRules | None, group: KVGroup, prompt_tokens: int, first: int, end: int,
              blocks_of: Callable[[int], tuple[int, ...]]) -> list[tuple[int, list[tuple[int, ...]]]]:
    """Runs of consecutive chunks in [first, end) that `group` stores, as (first chunk, each
    chunk's block ids); `blocks_of(chunk)` gives a chunk's block ids in this group."""
    runs: list[tuple[int, list[tuple[int, ...]]]] = []
    for chunk in range(first, end):
        ids = blocks_of(chunk)
        if rules is not None and not (rules.keeps(group, chunk, prompt_tokens) and storable(group, ids)):
            continue
        if runs and runs[-1][0] + len(runs[-1][1]) == chunk:
            runs[-1][1].append(ids)
        else:
            runs.append((chunk, [ids]))
    return runs


def load_run(group: KVGroup, blocks_of: Callable[[int], tuple[int, ...]], num_computed: int, load_end: int,
             chunk_tokens: int, block_size: int) -> tuple[int, list[tuple[int, ...]]] | None:
    """The chunks of `group` a load of tokens [num_computed, load_end) writes: (first chunk,
    each chunk's block ids), blocks the engine already holds or keeps none of (null) as
    SKIP, leading chunks with nothing to write left out; None if nothing is to be written."""
    first_chunk = num_computed // chunk_tokens
    first_needed_block = num_computed // block_size
    blocks = []
    for chunk in range(first_chunk, load_end // chunk_tokens):
        ids = loadable(group, blocks_of(chunk), SKIP)
        start = chunk * len(ids)
        blocks.append(tuple(SKIP if start + i < first_needed_block else b for i, b in enumerate(ids)))
    lead = next((i for i, ids in enumerate(blocks) if any(b != SKIP for b in ids)), len(blocks))
    return (first_chunk + lead, blocks[lead:]) if lead < len(blocks) else None
