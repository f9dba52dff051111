"""What one forward pass needs besides the token ids: where each token's keys are (AttentionBatch for the
engine's token-packed steps, kernels.graph.PaddedBatch for the ONNX export's padded rows), each token's k,
and the caches. Built once per step by the runner (or the export), read by every layer; nothing global."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moe_serve.kernels.graph import GraphCache, PaddedBatch
from moe_serve.kernels.latent import LatentCache
from moe_serve.kernels.vocabulary import AttentionBatch, RelativeTerm


@dataclass(frozen=True, slots=True)
class AdaptiveK:
    """The per-token terms of adaptive k (moe_serve.moe_policy), present when some token of the step has a
    top-p policy; a fixed-k token has cut = inf and min_k = its k, so it keeps exactly its k."""

    cut: torch.Tensor  # [T] fp32, the router probability each token's experts must reach
    min_k: torch.Tensor  # [T] the fewest experts each token takes
    experts_used: torch.Tensor  # [num_layers, S] int64: experts taken, summed over each sequence's tokens
    # (filled by the MoE layers on the device, read by the runner once per step: no host sync per layer)


@dataclass(frozen=True, slots=True)
class AttentionInputs:
    """One layer's attention in a step, as its kernel saw it: score(i, j) = scale * (q_i . k_j + q_rel_i .
    r_k[i - j]) over each query's visible keys, which are the cache's (or, without one, the step's own)."""

    q: torch.Tensor  # [T, H, Dh] (rotated; with Transformer-XL's r_w_bias added)
    k: torch.Tensor  # [T, G, Dh] this step's keys (rotated), already in the cache when there is one
    v: torch.Tensor  # [T, G, Dh]
    relative: RelativeTerm | None
    scale: float
    cache: tuple[torch.Tensor, torch.Tensor] | None  # the layer's paged keys and values
    o_weight: torch.Tensor  # [D, H * Dh] the output projection (head h's slice: W_O^h)


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    attention: AttentionBatch | PaddedBatch
    token_k: torch.Tensor  # [T] experts per token (each token's request k; under top-p the most it may take)
    max_k: int  # host int >= every token_k
    # Per layer: the paged keys and values [NB, G, Dh, BS] and [NB, G, BS, Dh] (a GraphCache in the export).
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | list[GraphCache] | None = None  # None: no cache
    router_states: dict[int, torch.Tensor] | None = None  # MoE layer -> [NB * BS, state_size] (stateful routers)
    block_size: int = 0  # of the paged cache, when there is one
    adaptive_k: AdaptiveK | None = None  # None: every token takes exactly its token_k
    # [S] the k of each sequence; None: its first token's (a padded row's first token may be padding, k 0).
    row_k: torch.Tensor | None = None
    # When a list: each MoE layer appends its tokens per expert [N] int64 (the ONNX graph's expert_counts).
    expert_counts: list[torch.Tensor] | None = None
    # The runner's engine.decode_stack.DecodeStack: the model runs the step's layers through it when it accepts
    # the batch (a decode-only CPU step), else layer by layer.
    decode_stack: Any = None
    # Per layer of a latent-attention model, its latent cache (kernels.latent) in place of keys and values.
    latent_caches: list[LatentCache] | None = None
    # A model with several KV groups (engine.kv_cache.KVLayout): each group's block tables and cache rows, and
    # each layer's group; empty for one group, whose are `attention`'s.
    group_attention: tuple[AttentionBatch, ...] = ()
    layer_groups: tuple[int, ...] = ()

    def attention_of(self, layer: int) -> AttentionBatch | PaddedBatch:
        """Where layer `layer`'s keys are: its KV group's block tables and cache rows."""
        return self.group_attention[self.layer_groups[layer]] if self.layer_groups else self.attention

    @classmethod
    def whole_sequences(cls, lengths: list[int], ks: list[int], device: torch.device | str = "cpu") -> ForwardBatch:
        """Whole sequences packed one after another, no cache, sequence s at k ks[s] (a reference forward
        outside the engine: evaluation.divergence, the tests)."""

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        attention = AttentionBatch(
            seq_ids=tensor([s for s, n in enumerate(lengths) for _ in range(n)]),
            positions=tensor([p for n in lengths for p in range(n)]),
            num_keys=tensor(lengths),
            seq_starts=tensor(starts),
            seq_lens=tuple(lengths),
            num_keys_host=tuple(lengths),
        )
        token_k = tensor([k for k, n in zip(ks, lengths, strict=True) for _ in range(n)])
        return cls(attention, token_k, max(ks))

    @property
    def seq_k(self) -> torch.Tensor:
        """[S] the k of each sequence."""
        if self.row_k is not None:
            return self.row_k
        assert isinstance(self.attention, AttentionBatch)
        return self.token_k[self.attention.seq_starts]
