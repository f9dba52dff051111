"""The paged KV cache: per layer, keys and values in fixed-size blocks (layout: kernels.vocabulary.cache_shapes), or for
a latent-attention model each token's latent (kernels.latent: kv_lora_rank + qk_rope_head_dim values per
layer), plus the per-token state of stateful routers, block-aligned with the keys. The pool is sized once, from
a memory budget in bytes, and never grows: what is allocated is what the budget allows, and no more.

Models whose layers differ in how far back they read (gpt-oss: sliding-window and full layers; Llama 4: local
chunks and global layers) split their layers into KV groups of equal size (KVLayout), as vLLM's hybrid
allocator does: every group has its own block table per sequence (engine.block_manager), and the groups share
one pool of block ids and one set of per-slot tensors, slot j holding the j-th layer of every group. A block
id taken by a group holds that group's layers only, so a sliding group gives its blocks back as its window
moves on (they serve the other groups then) while the full groups keep theirs. With g layers a group, a block
costs g layers' keys and values instead of every layer's: in the same memory gpt-oss (12 sliding, 12 full
layers) has twice the block ids, Llama 4 (36 chunked, 12 global) four times, and sequences past their windows
take about one block id per block of tokens instead of one per group. (A request is still admitted only if it
would fit with no group giving blocks back: CacheShape.sequence_tokens.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe_serve.kernels.latent import LatentCache, latent_cache_shape
from moe_serve.kernels.vocabulary import cache_shapes
from moe_serve.model_config import ModelConfig
from moe_serve.router_registry import router_class


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers that share a block table: what their queries read back (None: every earlier key; else at most
    `reach` keys, itself included: the blocks wholly before that are given back) and which layers they are."""

    reach: int | None
    layers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The KV groups of a model (module docstring); one group holding every layer for most models."""

    groups: tuple[KVGroup, ...]

    @property
    def num_slots(self) -> int:
        """Layers a block id holds: the size of every group."""
        return len(self.groups[0].layers)

    @property
    def reaches(self) -> tuple[int | None, ...]:
        return tuple(group.reach for group in self.groups)

    @property
    def layer_groups(self) -> tuple[int, ...]:
        """Each layer's group."""
        return tuple(self.group_of(layer) for layer in range(sum(len(group.layers) for group in self.groups)))

    def group_of(self, layer: int) -> int:
        return next(g for g, group in enumerate(self.groups) if layer in group.layers)

    def slot_of(self, layer: int) -> int:
        return self.groups[self.group_of(layer)].layers.index(layer)


def kv_layout(config: ModelConfig) -> KVLayout:
    """The full layers (reading every earlier key) and the local ones (a window or a local chunk), each cut
    into groups of the greatest common size; one group where all layers are alike. Local layers of different
    reaches share groups at the widest reach. A model with a stateful router keeps one group that reads all:
    its router reads every earlier token's state, block-aligned with the keys. Several groups come only with
    windows or chunks, which ModelConfig.attention_features names: the paths that refuse those (the decode
    stack, CUDA graphs, the ONNX export, the vLLM plugin) always see one group and read seq.block_table."""
    layers = tuple(range(config.num_layers))
    reaches = [config.attention_of(i).reach for i in layers]
    local = tuple(i for i in layers if reaches[i] is not None)
    if not local or router_state_sizes(config):
        return KVLayout((KVGroup(None, layers),))
    reach = max(r for r in reaches if r is not None)
    full = tuple(i for i in layers if reaches[i] is None)
    if not full:
        return KVLayout((KVGroup(reach, layers),))
    size = math.gcd(len(full), len(local))
    cut = lambda which: [which[i : i + size] for i in range(0, len(which), size)]  # noqa: E731
    return KVLayout(tuple(KVGroup(None, g) for g in cut(full)) + tuple(KVGroup(reach, g) for g in cut(local)))


@dataclass(frozen=True, slots=True)
class CacheShape:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    layout: KVLayout

    @property
    def sequence_tokens(self) -> int:
        """Tokens one sequence can hold at most if the pool were all its own and no group gave blocks back."""
        return self.num_tokens // len(self.layout.groups)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def router_state_sizes(config: ModelConfig) -> dict[int, int]:
    """MoE layer -> floats its router keeps per token (stateful kinds only)."""
    if config.moe is None:
        return {}
    size = router_class(config.moe.router.kind).state_size(config.moe.num_experts, config.hidden_size)
    return {layer: size for layer in config.moe.layers} if size else {}


def bytes_per_token(config: ModelConfig, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """Bytes of cache one token takes in `num_layers` layers (default: every layer), router states included."""
    assert config.num_kv_heads is not None and config.head_dim is not None
    element = torch.tensor([], dtype=dtype).element_size()
    layers = config.num_layers if num_layers is None else num_layers
    if config.latent_attention is not None:  # the latent and rope key, shared by the heads: no per-head K, V
        kv = layers * config.latent_attention.cache_width * element
    else:
        kv = 2 * layers * config.num_kv_heads * config.head_dim * element
    return kv + 4 * sum(router_state_sizes(config).values())


def cache_shape(config: ModelConfig, dtype: torch.dtype, budget_bytes: int, block_size: int) -> CacheShape:
    """As many blocks as the budget holds, a block holding the layers of one KV group (kv_layout)."""
    layout = kv_layout(config)
    per_block = bytes_per_token(config, dtype, layout.num_slots) * block_size
    return CacheShape(budget_bytes // per_block, block_size, per_block, layout)


class KVCache:
    def __init__(self, config: ModelConfig, shape: CacheShape, device: torch.device, dtype: torch.dtype) -> None:
        assert config.num_kv_heads is not None and config.head_dim is not None
        self.shape = shape
        # One block past the pool, never handed out: the padding rows of a CUDA-graph decode step write their
        # keys there and read them back (engine.decode_graphs), so padding never touches a sequence's blocks.
        self.scratch_block = shape.num_blocks
        keys, values = cache_shapes(shape.num_blocks + 1, shape.block_size, config.num_kv_heads, config.head_dim)
        # Uninitialised: pages are committed as blocks are first written; nothing reads a slot before that.
        # In 4 KiB pages, not huge ones (unlike the weights): a block's first write then commits only its own
        # pages. A huge page commits 2 MiB of every layer's keys and values at once, so one step in every
        # 2 MiB of pool growth stalled: on the development VM a first-touched huge page took 3-4.5 ms against
        # 0.65 ms for the same bytes in 4 KiB pages, and with the tiny benchmark model's 8 tensors the step
        # crossing block 256 took 70 ms against 6 ms decodes.
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.latent: list[LatentCache] = []  # a latent-attention model's, in place of `layers`
        if config.latent_attention is not None:
            assert shape.layout.num_slots == config.num_layers  # one group: ModelConfig refuses MLA with windows
            rows = latent_cache_shape(shape.num_blocks + 1, shape.block_size, config.latent_attention.cache_width)
            self.latent = [LatentCache(torch.empty(rows, dtype=dtype, device=device)) for _ in range(config.num_layers)]
        else:
            slots = [
                (torch.empty(keys, dtype=dtype, device=device), torch.empty(values, dtype=dtype, device=device))
                for _ in range(shape.layout.num_slots)
            ]
            self.layers = [slots[shape.layout.slot_of(i)] for i in range(config.num_layers)]
        self.router_states = {
            layer: torch.zeros(shape.num_tokens, size, device=device, dtype=torch.float32)
            for layer, size in router_state_sizes(config).items()
        }
