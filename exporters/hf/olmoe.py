"""OLMoE (`olmoe`): a q/k RMSNorm over all heads, `clip_qkv`, and `norm_topk_prob` (false: the chosen experts'
raw softmax mass)."""

from __future__ import annotations

from moe_serve.exporters.hf.family import HFFamily, register


@register
class Olmoe(HFFamily):
    name = "OLMoE"
    architectures = ("OlmoeForCausalLM",)
    num_experts_keys = ("num_experts",)
    expert_size_key = "intermediate_size"
    qk_norm = "full"
    moe_prefix = "mlp"
