"""What one forward pass over a token-packed batch needs besides the token ids: where each token's keys
are (AttentionBatch), each token's k, and the caches. Built once per step by the runner, read by every
layer; nothing global."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_serve.kernels.ops import AttentionBatch


@dataclass(frozen=True, slots=True)
class AdaptiveK:
    """The per-token terms of adaptive k (moe_serve.moe_policy), present when some token of the step has a
    top-p policy; a fixed-k token has cut = inf and min_k = its k, so it keeps exactly its k."""

    cut: torch.Tensor  # [T] fp32, the router probability each token's experts must reach
    min_k: torch.Tensor  # [T] the fewest experts each token takes
    experts_used: torch.Tensor  # [num_layers, S] int64: experts taken, summed over each sequence's tokens
    # (filled by the MoE layers on the device, read by the runner once per step: no host sync per layer)


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    attention: AttentionBatch
    top_k: torch.Tensor  # [T] experts per token (each token's request k; under top-p the most it may take)
    max_k: int  # host int >= every top_k
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer [NB, BS, G, Dh] x2; None: no cache
    router_states: dict[int, torch.Tensor] | None = None  # MoE layer -> [NB * BS, state_size] (stateful routers)
    block_size: int = 0  # of the paged cache, when there is one
    adaptive_k: AdaptiveK | None = None  # None: every token takes exactly its top_k

    @property
    def seq_top_k(self) -> torch.Tensor:
        """[S] the k of each sequence (its first token's)."""
        return self.top_k[self.attention.seq_starts]
