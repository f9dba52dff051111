"""GLM-4.5 (`glm4_moe`): DeepSeek-V3's MoE (router kind grouped_topk with the correction bias, dense first
layers, shared experts: deepseek.py's functions) with ordinary attention, its per-head q/k RMSNorm (use_qk_norm)
and partial rotary (partial_rotary_factor: the first rotary_dim dims of each head rotate as halves of their own;
the export reorders q/k rows for ModelConfig.rotary_dim: reorder.partial_rotary_rows)."""

from __future__ import annotations

from typing import Any

import torch

from moe_serve.exporters.hf.deepseek import first_dense_layers, reachable_k, shared_experts, v3_router
from moe_serve.exporters.hf.family import HFFamily, register
from moe_serve.exporters.hf.reorder import partial_rotary_rows
from moe_serve.layers.routers import RouterConfig
from moe_serve.model_config import Activation, FFNConfig, ModelConfig, RopeScaling


@register
class Glm4Moe(HFFamily):
    name = "GLM-4.5"
    architectures = ("Glm4MoeForCausalLM",)
    num_experts_keys = ("n_routed_experts",)
    expert_size_key = "moe_intermediate_size"
    qk_norm = "per_head"
    qk_norm_key = "use_qk_norm"
    moe_prefix = "mlp"
    shared_expert_prefix = "mlp.shared_experts"  # n_shared_experts of moe_intermediate_size
    defaults = {  # Glm4MoeConfig's
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1,
        "n_shared_experts": 1,
        "use_qk_norm": False,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    }

    def moe_layers(self, hf: dict[str, Any]) -> tuple[int, ...]:
        return first_dense_layers(hf)

    def router(self, hf: dict[str, Any]) -> RouterConfig:
        return v3_router(hf)

    def max_k(self, hf: dict[str, Any], num_experts: int) -> int:
        return reachable_k(hf, self.router(hf), num_experts)

    def shared_expert(self, hf: dict[str, Any], activation: Activation) -> FFNConfig | None:
        return shared_experts(hf, activation)

    def heads(self, hf: dict[str, Any], scaling: RopeScaling | None) -> dict[str, Any]:
        """And rotary_dim: transformers rotates int(head_dim * partial_rotary_factor) dims of each head."""
        fields = super().heads(hf, scaling)
        factor = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor"))
        if factor is not None and factor != 1.0:
            head_dim = fields["head_dim"] or hf["hidden_size"] // hf["num_attention_heads"]
            fields["rotary_dim"] = int(head_dim * factor)
        return fields

    def qk_rows(self, rows: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        """Every row of a head (bias and per-head norm weights included) in ModelConfig.rotary_dim's order."""
        if config.rotary_dim is None:
            return rows
        assert config.head_dim is not None
        return partial_rotary_rows(rows, config.head_dim, config.rotary_dim)
