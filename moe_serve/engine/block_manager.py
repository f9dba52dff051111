"""KV-cache blocks in plain Python: allocation, reference counts, and prefix caching of full blocks.

A sequence's KV cache is a list of fixed-size blocks (its block table), one table per KV group of the model
(engine.kv_cache.KVLayout: most models have one; gpt-oss and Llama 4 have full groups and groups whose layers
read only recent keys). A block that is full gets a hash chained from the previous block's hash, its tokens,
and the sequence's cache salt (its k: the keys and values after an MoE layer depend on the experts a request
used, so two requests share a block only if they ran at the same k); each group's block is found under its
group and that hash. Freed blocks keep their hash and stay findable until they are reused, oldest freed first
(LRU), so a repeated prompt prefix is found again even after its request finished. A group with a reach gives
back the blocks wholly behind its next query's reach as the sequence advances (release_unreachable).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from moe_serve.engine.sequence import Sequence

# A block table entry whose block was given back (release_unreachable): never read, as no query reaches it. A
# valid index (the last block), so gathers that read whole tables stay in bounds; their rows are dropped.
RELEASED = -1


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()  # of a full block, to rule out hash collisions
    group: int = 0  # the KV group whose layers it holds, while hashed


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """What admission found in the prefix cache: the prompt's first num_blocks blocks, computed at the same k.
    Per group, their ids; RELEASED before the reach of a group that reads only recent keys (it needs none)."""

    num_blocks: int
    tables: tuple[tuple[int, ...], ...]
    hashes: tuple[int, ...]

    @property
    def ids(self) -> list[int]:
        return [b for table in self.tables for b in table if b != RELEASED]


@dataclass(slots=True)
class PrefixCacheStats:
    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(slots=True)
class BlockManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    # Per KV group (KVLayout.reaches): None where its layers read every earlier key, else the most keys back
    # any of its queries reads (itself included).
    reaches: tuple[int | None, ...] = (None,)
    blocks: list[Block] = field(init=False)
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    _free: OrderedDict[int, None] = field(init=False)  # free block ids, least recently freed first
    _by_hash: dict[tuple[int, int], int] = field(init=False, default_factory=dict)  # (group, hash) -> block id

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self._free = OrderedDict.fromkeys(range(self.num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _first_kept(self, reach: int | None, position: int) -> int:
        """The first block a query at `position` (and every later one) reads in a group of this reach."""
        return 0 if reach is None else max(0, position - reach + 1) // self.block_size

    # ---- admission --------------------------------------------------------------------------------

    def no_prefix(self) -> CachedPrefix:
        return CachedPrefix(0, tuple(() for _ in self.reaches), ())

    def cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """The longest prefix of `seq` already computed at the same k whose blocks every group needs are all
        found: a full group's from the first, a local group's within the reach of the next query. The last
        prompt token is never taken from the cache: its logits are needed."""
        if not self.enable_prefix_caching:
            return self.no_prefix()
        hashes: list[int] = []

        def find(group: int, i: int) -> int | None:
            block_id = self._by_hash.get((group, hashes[i]))
            return (
                block_id if block_id is not None and self.blocks[block_id].token_ids == self._tokens(seq, i) else None
            )

        full = [group for group, reach in enumerate(self.reaches) if reach is None]
        n, parent = 0, seq.cache_salt
        for i in range((seq.num_tokens - 1) // self.block_size):
            parent = hash((parent, self._tokens(seq, i)))
            hashes.append(parent)
            if any(find(group, i) is None for group in full):  # full groups need every block from the first
                break
            n = i + 1
        # The longest n whose local groups all have every block from the next query's first key on: per group,
        # the last missing block before each n, in one pass (not a rescan of the reach for every n tried).
        local: list[tuple[int, list[int]]] = []  # (reach, the last missing block before each n)
        for group, reach in enumerate(self.reaches):
            if reach is not None:
                missing_before = [-1]
                for i in range(n):
                    missing_before.append(i if find(group, i) is None else missing_before[-1])
                local.append((reach, missing_before))
        n = next(
            m
            for m in range(n, -1, -1)
            if all(before[m] < self._first_kept(reach, m * self.block_size) for reach, before in local)
        )

        def entry(group: int, reach: int | None, i: int) -> int:
            block_id = find(group, i) if i >= self._first_kept(reach, n * self.block_size) else RELEASED
            assert block_id is not None  # found above
            return block_id

        tables = tuple(tuple(entry(group, reach, i) for i in range(n)) for group, reach in enumerate(self.reaches))
        return CachedPrefix(n, tables, tuple(hashes[:n]))

    def _tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def can_allocate(self, seq: Sequence, num_tokens: int, cached: CachedPrefix, reserved: int = 0) -> bool:
        """Whether `seq` (holding no blocks) can be given blocks for its first num_tokens tokens, with `reserved`
        free blocks left over (promised to others)."""
        revived = sum(1 for b in cached.ids if self.blocks[b].ref_count == 0)  # cached but free: they count
        fresh = len(self.reaches) * (self.blocks_needed(num_tokens) - cached.num_blocks)
        return fresh + revived + reserved <= len(self._free)

    def blocks_to_finish(self, seq: Sequence) -> int:
        """The blocks `seq` still needs to hold its whole prompt (and what it generated), over every group."""
        want = self.blocks_needed(seq.num_tokens)
        held = [len(table) for table in seq.block_tables] or [0] * len(self.reaches)
        return sum(max(want - n, 0) for n in held)

    def allocate(self, seq: Sequence, num_tokens: int, cached: CachedPrefix) -> None:
        """Take the cached blocks and fresh ones for the first num_tokens tokens; marks the hit."""
        for block_id in cached.ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        seq.block_tables = [list(table) for table in cached.tables]
        seq.num_released_blocks = [table.count(RELEASED) for table in cached.tables]
        seq.block_hashes = list(cached.hashes)
        seq.num_computed_tokens = seq.num_cached_tokens = cached.num_blocks * self.block_size
        self.stats.queried_tokens += seq.num_prompt_tokens
        self.stats.hit_tokens += seq.num_cached_tokens
        self._grow(seq, num_tokens)

    # ---- running ----------------------------------------------------------------------------------

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can hold num_tokens more tokens than it has computed."""
        want = self.blocks_needed(seq.num_computed_tokens + num_tokens)
        held = [len(table) for table in seq.block_tables] or [0] * len(self.reaches)
        return sum(want - n for n in held) <= len(self._free)

    def append(self, seq: Sequence, num_tokens: int) -> None:
        self._grow(seq, seq.num_computed_tokens + num_tokens)

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        if not seq.block_tables:  # holding no blocks yet: one empty table per group
            seq.block_tables = [[] for _ in self.reaches]
            seq.num_released_blocks = [0] * len(self.reaches)
        for table in seq.block_tables:
            for _ in range(self.blocks_needed(num_tokens) - len(table)):
                table.append(self._take_free())

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self._by_hash.get((block.group, block.hash)) == block_id:
            del self._by_hash[(block.group, block.hash)]  # its cached content is evicted now
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def commit(self, seq: Sequence) -> None:
        """After a step: hash the blocks that became full (their keys and values are now computed)."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else seq.cache_salt
        for i in range(len(seq.block_hashes), full):
            tokens = self._tokens(seq, i)
            parent = hash((parent, tokens))
            for group, table in enumerate(seq.block_tables):
                block = self.blocks[table[i]]  # never RELEASED: a block is released only once committed
                block.hash, block.token_ids, block.group = parent, tokens, group
                self._by_hash[(group, parent)] = block.block_id
            seq.block_hashes.append(parent)

    def release_unreachable(self, seq: Sequence) -> None:
        """Give back, in each group with a reach, the blocks wholly before what the next query of `seq` reads
        (it is at num_computed_tokens; later ones read less far back). Their table entries become RELEASED;
        the blocks keep their hashes, so the prefix stays findable until they are reused."""
        for group, reach in enumerate(self.reaches):
            table = seq.block_tables[group]
            end = min(self._first_kept(reach, seq.num_computed_tokens), len(table))
            for i in range(seq.num_released_blocks[group], end):  # the entries before are RELEASED already
                self._release(table[i])
                table[i] = RELEASED
            seq.num_released_blocks[group] = max(seq.num_released_blocks[group], end)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks, tail first across the groups (so a shared prefix outlives its tails,
        which LRU reuses first), and at each position the local groups' before the full ones' (a hit needs
        the full groups' blocks from the first, a local group's only near its end)."""
        order = sorted(range(len(seq.block_tables)), key=lambda g: self.reaches[g] is None)
        for i in reversed(range(len(seq.block_table))):
            for group in order:
                if seq.block_tables[group][i] != RELEASED:
                    self._release(seq.block_tables[group][i])
        seq.block_tables = []
        seq.num_released_blocks = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
