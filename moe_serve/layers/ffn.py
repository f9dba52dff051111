"""Feed-forward networks: a dense FFN and a stacked bank of experts, in the three kinds of FFNConfig.

Legend: T tokens, S token-expert slots, E experts, B sequences, L tokens per sequence,
D hidden size, I intermediate (or bottleneck) size.

One function, `apply_ffn`, spells out each kind's math once; the callers differ only in how one named
linear map is applied (plain, grouped by expert, or with per-sequence merged weights).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from moe_serve.model_config import FFNConfig

LinearFn = Callable[[str, torch.Tensor], torch.Tensor]

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def linear_shapes(config: FFNConfig, hidden_size: int) -> dict[str, tuple[int, int, bool]]:
    """Each linear map of an FFN kind: name -> (out features, in features, has bias)."""
    i, d, bias = config.intermediate_size, hidden_size, config.use_bias
    if config.kind == "mlp":
        return {"fc1": (i, d, bias), "fc2": (d, i, bias)}
    if config.kind == "glu":
        return {"gate_proj": (i, d, bias), "up_proj": (i, d, bias), "down_proj": (d, i, bias)}
    # SMEAR's adapter: the down projection always has a bias, the up projection only with use_bias.
    return {"down": (i, d, True), "up": (d, i, bias)}


def apply_ffn(config: FFNConfig, linear: LinearFn, x: torch.Tensor) -> torch.Tensor:
    act = ACTIVATIONS[config.activation]
    if config.kind == "mlp":
        return linear("fc2", act(linear("fc1", x)))
    if config.kind == "glu":
        return linear("down_proj", act(linear("gate_proj", x)) * linear("up_proj", x))
    return linear("up", act(linear("down", x)))


class FFN(nn.Module):
    """A dense FFN (also the shared expert of an MoE layer)."""

    def __init__(self, config: FFNConfig, hidden_size: int) -> None:
        super().__init__()
        self.config = config
        for name, (out_features, in_features, bias) in linear_shapes(config, hidden_size).items():
            self.add_module(name, nn.Linear(in_features, out_features, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_ffn(self.config, lambda name, h: getattr(self, name)(h), x)


class ExpertBank(nn.Module):
    """E experts of one kind, stacked: `<linear>.weight` [E, out, in] and `<linear>.bias` [E, out]."""

    def __init__(self, config: FFNConfig, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.config = config
        self.num_experts = num_experts
        self.shapes = linear_shapes(config, hidden_size)
        for name, (out_features, in_features, bias) in self.shapes.items():
            module = nn.Module()
            module.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
            module.bias = nn.Parameter(torch.zeros(num_experts, out_features)) if bias else None
            self.add_module(name, module)

    def _weight(self, name: str) -> torch.Tensor:
        return getattr(self, name).weight

    def _bias(self, name: str) -> torch.Tensor | None:
        return getattr(self, name).bias

    def forward_grouped(
        self,
        x: torch.Tensor,  # [T, D]
        topk_ids: torch.Tensor,  # [T, K] expert per slot, -1 for slots beyond the token's k
        topk_weights: torch.Tensor,  # [T, K] fp32, 0 for unused slots
    ) -> torch.Tensor:
        """Sum over each token's slots of weight * expert(x). Every used slot is computed exactly once;
        slots are grouped by expert and each expert runs once on its slice (grouped GEMM)."""
        t, k = topk_ids.shape
        used = topk_ids >= 0  # [T, K]
        slot_expert = topk_ids[used]  # [S]
        slot_token = torch.arange(t, device=x.device)[:, None].expand(t, k)[used]  # [S]
        order = torch.argsort(slot_expert, stable=True)  # [S] slots sorted by expert
        sorted_expert = slot_expert[order]  # [S]
        counts = torch.bincount(slot_expert, minlength=self.num_experts)  # [E]
        offsets = torch.cumsum(counts, 0).to(torch.int32)  # [E] end of each expert's group

        def grouped_linear(name: str, h: torch.Tensor) -> torch.Tensor:
            out = _grouped_mm(h, self._weight(name), offsets)  # [S, out]
            bias = self._bias(name)
            return out if bias is None else out + bias[sorted_expert]

        sorted_out = apply_ffn(self.config, grouped_linear, x[slot_token[order]])  # [S, D]
        slot_out = torch.empty_like(sorted_out)
        slot_out[order] = sorted_out
        per_slot = x.new_zeros(t, k, x.shape[-1])  # [T, K, D]
        per_slot[used] = slot_out
        # Combine in slot order with fixed weights: no atomics, so a token's sum is batch-independent.
        return (per_slot.float() * topk_weights[..., None]).sum(1).to(x.dtype)  # [T, D]

    def forward_merged(
        self,
        x: torch.Tensor,  # [B, L, D]
        topk_ids: torch.Tensor,  # [B, K] experts merged for each sequence, -1 beyond its k
        topk_weights: torch.Tensor,  # [B, K] fp32 merge weights (sum to 1 over used slots)
    ) -> torch.Tensor:
        """Apply, per sequence, one expert whose parameters are the weighted average of the chosen
        experts' parameters (SMEAR's parameter merging)."""
        ids = topk_ids.clamp(min=0)  # unused slots carry weight 0
        weights = topk_weights.to(x.dtype)

        def merge(param: torch.Tensor) -> torch.Tensor:  # [E, ...] -> [B, ...]
            return torch.einsum("bk,bk...->b...", weights, param[ids])

        def merged_linear(name: str, h: torch.Tensor) -> torch.Tensor:
            out = torch.bmm(h, merge(self._weight(name)).transpose(1, 2))  # [B, L, out]
            bias = self._bias(name)
            return out if bias is None else out + merge(bias)[:, None, :]

        return apply_ffn(self.config, merged_linear, x)


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [S, in] sorted by expert, weight [E, out, in], offsets [E] group ends -> [S, out]."""
    grouped_mm = getattr(F, "grouped_mm", None)  # torch >= 2.9
    if grouped_mm is not None and (x.device.type == "cpu" or x.dtype == torch.bfloat16):
        return grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    # Older torch, or CUDA in fp32/fp16 (its grouped GEMM takes bf16): pad groups to the largest, one bmm.
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).long()  # [E]
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts)  # [S]
    row_in_group = torch.arange(x.shape[0], device=x.device) - (offsets.long() - counts)[expert_of_row]
    capacity = int(counts.max()) if x.shape[0] else 0
    padded = x.new_zeros(len(counts), capacity, x.shape[1])  # [E, C, in]
    padded[expert_of_row, row_in_group] = x
    out = torch.bmm(padded, weight.transpose(1, 2))  # [E, C, out]
    return out[expert_of_row, row_in_group]
