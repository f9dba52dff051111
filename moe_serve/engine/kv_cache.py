"""The paged KV cache: per layer, keys and values in fixed-size blocks (layout: kernels.ops.cache_shapes), or for
a latent-attention model each token's latent (kernels.latent: kv_lora_rank + qk_rope_head_dim values per
layer), plus the per-token state of stateful routers, block-aligned with the keys. The pool is sized once, from
a memory budget in bytes, and never grows: what is allocated is what the budget allows, and no more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_serve.kernels.latent import LatentCache, latent_cache_shape
from moe_serve.kernels.ops import cache_shapes
from moe_serve.layers.routers import router_class
from moe_serve.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class CacheShape:
    num_blocks: int
    block_size: int
    bytes_per_block: int

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


def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    assert config.num_kv_heads is not None and config.head_dim is not None
    element = torch.tensor([], dtype=dtype).element_size()
    if config.latent_attention is not None:  # the latent and rope key, shared by the heads: no per-head K, V
        kv = config.num_layers * config.latent_attention.cache_width * element
    else:
        kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * element
    return kv + 4 * sum(router_state_sizes(config).values())


def cache_shape(config: ModelConfig, dtype: torch.dtype, budget_bytes: int, block_size: int) -> CacheShape:
    per_block = bytes_per_token(config, dtype) * block_size
    return CacheShape(budget_bytes // per_block, block_size, per_block)


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
            rows = latent_cache_shape(shape.num_blocks + 1, shape.block_size, config.latent_attention.cache_width)
            self.latent = [LatentCache(torch.empty(rows, dtype=dtype, device=device)) for _ in range(config.num_layers)]
        else:
            self.layers = [
                (torch.empty(keys, dtype=dtype, device=device), torch.empty(values, dtype=dtype, device=device))
                for _ in range(config.num_layers)
            ]
        self.router_states = {
            layer: torch.zeros(shape.num_tokens, size, device=device, dtype=torch.float32)
            for layer, size in router_state_sizes(config).items()
        }
