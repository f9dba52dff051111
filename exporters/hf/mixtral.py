"""Mixtral (`mixtral`): experts `w1` / `w3` / `w2` under `block_sparse_moe`, the top k by logit renormalised
(`topk_softmax`, normalize), and a `sliding_window` that, when set, slides in every layer."""

from __future__ import annotations

from typing import Any

from moe_serve.exporters.hf.family import HFFamily, register
from moe_serve.model_config import LayerAttention

# the artifact's GLU linear name -> Mixtral's per-expert name (Phi-3.5-MoE's too)
MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


@register
class Mixtral(HFFamily):
    name = "Mixtral"
    architectures = ("MixtralForCausalLM",)
    num_experts_keys = ("num_local_experts",)
    expert_size_key = "intermediate_size"
    default_norm_topk_prob = True
    moe_prefix = "block_sparse_moe"
    expert_names = MIXTRAL_NAMES

    def layer_attention(self, hf: dict[str, Any], positions: int) -> dict[str, Any]:
        """With sliding_window set, transformers' mask slides in every layer: a window of that many keys in each
        (a wider one than the positions served changes nothing, and is dropped)."""
        window = hf.get("sliding_window")
        if isinstance(window, int) and window < positions:
            return {"layer_attention": (LayerAttention(window=window),) * hf["num_hidden_layers"]}
        return {}
