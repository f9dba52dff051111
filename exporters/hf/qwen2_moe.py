"""Qwen2-MoE (`qwen2_moe`): a shared expert scaled by sigmoid(x w) beside the routed ones, q/k/v biases by
default, `decoder_sparse_step` / `mlp_only_layers` choosing the MoE layers, and `norm_topk_prob` (false: the
chosen experts' raw softmax mass)."""

from __future__ import annotations

from typing import Any

from moe_serve.exporters.hf.family import HFFamily, decoder_sparse_step_layers, register


@register
class Qwen2Moe(HFFamily):
    name = "Qwen2-MoE"
    architectures = ("Qwen2MoeForCausalLM",)
    num_experts_keys = ("num_experts",)
    expert_size_key = "moe_intermediate_size"
    shared_expert_size_key = "shared_expert_intermediate_size"
    shared_expert_gate = True
    default_attention_bias = True
    moe_prefix = "mlp"
    shared_expert_prefix = "mlp.shared_expert"

    def moe_layers(self, hf: dict[str, Any]) -> tuple[int, ...]:
        return decoder_sparse_step_layers(hf)
