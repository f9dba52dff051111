"""Granite-MoE (`granitemoe`): the embedding, residual, attention and logits multipliers, the top k by logit
renormalised (`topk_softmax`, normalize), biases on q/k/v/o, and the experts fused into two banks beside the
router (`input_linear` [N, 2I, D]: gate rows, then up rows; `output_linear` [N, D, I])."""

from __future__ import annotations

from typing import Any

import torch

from moe_serve.exporters.base import ExportError, SafetensorsCheckpoint
from moe_serve.exporters.hf.family import HFFamily, register


@register
class GraniteMoe(HFFamily):
    name = "Granite-MoE"
    architectures = ("GraniteMoeForCausalLM",)
    num_experts_keys = ("num_local_experts",)
    expert_size_key = "intermediate_size"
    default_norm_topk_prob = True
    attention_out_bias = True
    moe_prefix = "block_sparse_moe"
    router_name = "router.layer"

    def scales(self, hf: dict[str, Any]) -> dict[str, Any]:
        """embedding_multiplier, residual_multiplier, attention_multiplier (the softmax scale, in place of
        1/sqrt(head_dim)) and logits_scaling (a divisor), each transformers' 1.0 where absent."""
        values = {}
        for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
            value = hf.get(key, 1.0)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ExportError(f"config.json: {key} must be a number; got {value!r}")
            values[key] = float(value)
        return {
            "embedding_scale": values["embedding_multiplier"],
            "residual_scale": values["residual_multiplier"],
            "attention_scale": values["attention_multiplier"],
            "logits_divisor": values["logits_scaling"],
        }

    def experts(
        self, checkpoint: SafetensorsCheckpoint, moe: str, dst: str, n: int, d: int, i: int
    ) -> dict[str, torch.Tensor]:
        return fused_glu(checkpoint, moe, dst, (n,), d, i)


def fused_glu(
    checkpoint: SafetensorsCheckpoint, src: str, dst: str, bank: tuple[int, ...], d: int, i: int
) -> dict[str, torch.Tensor]:
    """Granite's layout, for its experts (bank = (N,)) and its shared MLP (bank = ()): input_linear holds the
    gate rows then the up rows (transformers chunks its output in two, gate first), output_linear the down."""
    gate_up = checkpoint.get(src + "input_linear.weight", (*bank, 2 * i, d))
    return {
        dst + "gate_proj.weight": gate_up[..., :i, :].contiguous(),
        dst + "up_proj.weight": gate_up[..., i:, :].contiguous(),
        dst + "down_proj.weight": checkpoint.get(src + "output_linear.weight", (*bank, d, i)),
    }
