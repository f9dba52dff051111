"""Qwen3-MoE (`qwen3_moe`): Qwen's MoE-layer rule and `norm_topk_prob` without a shared expert, with a per-head
q/k RMSNorm."""

from __future__ import annotations

from typing import Any

from moe_serve.exporters.hf.family import HFFamily, decoder_sparse_step_layers, register


@register
class Qwen3Moe(HFFamily):
    name = "Qwen3-MoE"
    architectures = ("Qwen3MoeForCausalLM",)
    num_experts_keys = ("num_experts", "num_local_experts")
    expert_size_key = "moe_intermediate_size"
    qk_norm = "per_head"
    moe_prefix = "mlp"

    def moe_layers(self, hf: dict[str, Any]) -> tuple[int, ...]:
        return decoder_sparse_step_layers(hf)
