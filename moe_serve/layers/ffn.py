"""Feed-forward networks: a dense FFN and a stacked bank of experts, in the three kinds of FFNConfig.

Legend: T tokens, K slots per token, E experts, L tokens of one sequence, D hidden size, I intermediate
(or bottleneck) size.

One function, `apply_ffn`, spells out each kind's math once; the callers differ only in how one named
linear map is applied (plain, grouped by expert, or with per-sequence merged weights).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moe_serve.kernels import ops, sequences
from moe_serve.kernels.graph import PaddedBatch
from moe_serve.kernels.vocabulary import ACTIVATIONS, AttentionBatch, ExpertWeights, SwiGLUClamp, glu
from moe_serve.model_config import FFNConfig

LinearFn = Callable[[str, torch.Tensor], torch.Tensor]


def linear_shapes(config: FFNConfig, hidden_size: int) -> dict[str, tuple[int, int, bool]]:
    """Each linear map of an FFN kind: name -> (out features, in features, has bias)."""
    i, d, bias = config.intermediate_size, hidden_size, config.use_bias
    if config.kind == "mlp":
        return {"fc1": (i, d, bias), "fc2": (d, i, bias)}
    if config.kind == "glu":
        return {"gate_proj": (i, d, bias), "up_proj": (i, d, bias), "down_proj": (d, i, bias)}
    # SMEAR's adapter: the down projection always has a bias, the up projection only with use_bias.
    return {"down": (i, d, True), "up": (d, i, bias)}


def swiglu_of(config: FFNConfig) -> SwiGLUClamp | None:
    """The clamped SwiGLU's parameters as the kernels take them (activation swigluoai), else None."""
    if config.swiglu_alpha is None or config.swiglu_limit is None:
        return None
    return SwiGLUClamp(config.swiglu_alpha, config.swiglu_limit)


def apply_ffn(config: FFNConfig, linear: LinearFn, x: torch.Tensor) -> torch.Tensor:
    if config.kind == "glu":
        gated = glu(config.activation, linear("gate_proj", x), linear("up_proj", x), swiglu_of(config))
        return linear("down_proj", gated)
    act = ACTIVATIONS[config.activation]
    if config.kind == "mlp":
        return linear("fc2", act(linear("fc1", x)))
    return linear("up", act(linear("down", x)))


class FFN(nn.Module):
    """A dense FFN (also the shared expert of an MoE layer)."""

    def __init__(self, config: FFNConfig, hidden_size: int) -> None:
        super().__init__()
        self.config = config
        for name, (out_features, in_features, bias) in linear_shapes(config, hidden_size).items():
            self.add_module(name, nn.Linear(in_features, out_features, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def linear(name: str, h: torch.Tensor) -> torch.Tensor:
            layer = getattr(self, name)
            return ops.linear(h, layer.weight, layer.bias)

        return apply_ffn(self.config, linear, x)


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
            module.register_parameter("bias", nn.Parameter(torch.zeros(num_experts, out_features)) if bias else None)
            self.add_module(name, module)

    def _weight(self, name: str) -> torch.Tensor:
        return getattr(self, name).weight

    def _bias(self, name: str) -> torch.Tensor | None:
        return getattr(self, name).bias

    def weights(self) -> ExpertWeights:
        """The bank in the kernel's terms: y = act(x w1^T + b1) [* (x w3^T + b3)] w2^T + b2."""
        first, *gate_up, last = {
            "mlp": ("fc1", "fc2"),
            "glu": ("gate_proj", "up_proj", "down_proj"),
            "adapter": ("down", "up"),
        }[self.config.kind]
        w3 = b3 = None
        if gate_up:
            w3, b3 = self._weight(gate_up[0]), self._bias(gate_up[0])
        return ExpertWeights(
            self._weight(first),
            self._weight(last),
            self.config.activation,
            self._bias(first),
            w3,
            b3,
            self._bias(last),
            swiglu_of(self.config),
        )

    def forward_merged(
        self,
        x: torch.Tensor,  # [T, D] the tokens of S sequences
        topk_ids: torch.Tensor,  # [S, K] experts merged for each sequence, -1 beyond its k
        topk_weights: torch.Tensor,  # [S, K] fp32 merge weights (sum to 1 over used slots)
        batch: AttentionBatch | PaddedBatch,  # which tokens belong to which sequence
    ) -> torch.Tensor:
        """Each sequence's tokens through one expert whose parameters are the weighted average of the
        experts chosen for it (SMEAR's parameter merging)."""
        ids = topk_ids.clamp(min=0)  # unused slots carry weight 0

        def merged_linear(name: str, h: torch.Tensor) -> torch.Tensor:
            bias = self._bias(name)
            weight = sequences.merge(topk_weights, ids, self._weight(name), batch)  # [S, out, in]
            merged_bias = None if bias is None else sequences.merge(topk_weights, ids, bias, batch)
            return sequences.sequence_linear(h, weight, merged_bias, batch)

        return apply_ffn(self.config, merged_linear, x)
