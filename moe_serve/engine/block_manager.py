"""KV-cache blocks in plain Python: allocation, reference counts, and prefix caching of full blocks.

A sequence's KV cache is a list of fixed-size blocks (its block table). A block that is full gets a hash
chained from the previous block's hash, its tokens, and the sequence's cache salt (its k: the keys and
values after an MoE layer depend on the experts a request used, so two requests share a block only if
they ran at the same k). Freed blocks keep their hash and stay findable until they are reused, oldest
freed first (LRU), so a repeated prompt prefix is found again even after its request finished.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from moe_serve.engine.sequence import Sequence

# A block table entry whose block was given back (release_before): never read, as no query reaches it. A
# valid index (the last block), so gathers that read whole tables stay in bounds; their rows are dropped.
RELEASED = -1


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()  # of a full block, to rule out hash collisions


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
    blocks: list[Block] = field(init=False)
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    _free: OrderedDict[int, None] = field(init=False)  # free block ids, least recently freed first
    _by_hash: dict[int, int] = field(init=False, default_factory=dict)

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

    # ---- admission --------------------------------------------------------------------------------

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding a prefix of `seq` already computed at the same k. The last prompt token is never
        taken from the cache: its logits are needed."""
        if not self.enable_prefix_caching:
            return []
        found, parent = [], seq.cache_salt
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = hash((parent, tokens))
            block_id = self._by_hash.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            found.append(block_id)
        return found

    def can_allocate(self, seq: Sequence, num_tokens: int, cached: list[int]) -> bool:
        """Whether `seq` (holding no blocks) can be given blocks for its first num_tokens tokens."""
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)  # cached but free: they count
        return self.blocks_needed(num_tokens) - len(cached) + revived <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int, cached: list[int]) -> None:
        """Take the cached blocks and fresh ones for the first num_tokens tokens; marks the hit."""
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.block_hashes = [self.blocks[b].hash for b in cached]  # type: ignore[misc]  # cached blocks are hashed
        seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * self.block_size
        self.stats.queried_tokens += seq.num_prompt_tokens
        self.stats.hit_tokens += seq.num_cached_tokens
        self._grow(seq, num_tokens)

    # ---- running ----------------------------------------------------------------------------------

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can hold num_tokens more tokens than it has computed."""
        need = self.blocks_needed(seq.num_computed_tokens + num_tokens) - len(seq.block_table)
        return need <= len(self._free)

    def append(self, seq: Sequence, num_tokens: int) -> None:
        self._grow(seq, seq.num_computed_tokens + num_tokens)

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.blocks_needed(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_free())

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self._by_hash.get(block.hash) == block_id:
            del self._by_hash[block.hash]  # its cached content is evicted now
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def commit(self, seq: Sequence) -> None:
        """After a step: hash the blocks that became full (their keys and values are now computed)."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else seq.cache_salt
        for i in range(len(seq.block_hashes), full):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = hash((parent, tokens))
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = parent, tokens
            self._by_hash[parent] = block.block_id
            seq.block_hashes.append(parent)

    def release_before(self, seq: Sequence, position: int) -> None:
        """Give back the blocks wholly before `position`, which no later query of `seq` reads (a model whose
        every layer attends to a window: SchedulerConfig.attention_reach). Their table entries become RELEASED;
        the blocks keep their hashes, so the prefix stays findable until they are reused."""
        for i in range(seq.num_released_blocks, min(position // self.block_size, len(seq.block_table))):
            self._release(seq.block_table[i])
            seq.block_table[i] = RELEASED
            seq.num_released_blocks = i + 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks, tail first (so a shared prefix outlives its tails)."""
        for block_id in reversed(seq.block_table):
            if block_id != RELEASED:
                self._release(block_id)
        seq.block_table = []
        seq.num_released_blocks = 0
        seq.block_hashes = []
        seq.num_computed_tokens = 0
