"""DeepSeek-V2 and DeepSeek-V3 (`deepseek_v2`, `deepseek_v3`; Kimi K2 ships DeepSeek-V3's architecture), as
transformers' modeling_deepseek_v2 / modeling_deepseek_v3 compute them in eval mode.

- Multi-head latent attention (ModelConfig.latent_attention, served by moe_serve/layers/latent_attention.py):
  q_proj, or q_a_proj / q_a_layernorm / q_b_proj (q_lora_rank); kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
  o_proj; attention_bias puts a bias on q_a, kv_a and o only, as transformers builds them. transformers rotates
  the rope dims as interleaved pairs (V2 always, through complex numbers; V3 when rope_interleave, its
  default); the export de-interleaves those rows of the q and kv_a projections (evens, then odds:
  reorder.latent_q_rows, reorder.latent_kv_rows) so that the runtime's rotate-half rotary applies: V3's
  interleaved rotation is exactly rotate-half on the de-interleaved dims, and V2's rotated pairs are the same
  values in pair order, so every q . k is unchanged.
- The softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 when a rotary scaling sets
  mscale_all_dim (transformers' yarn_apply_mscale); the rotary tables cover qk_rope_head_dim (head_dim).
- The first `first_k_dense_replace` layers dense (intermediate_size), every later one MoE; transformers
  ignores moe_layer_freq, so a value other than 1 (where DeepSeek's own code would skip layers) is refused.
- n_shared_experts experts of moe_intermediate_size, always on and ungated: one GLU of that total size.
- The router, kind grouped_topk (moe_serve/layers/routers/grouped_topk.py says what k means there): V3 sigmoid
  scores, chosen with e_score_correction_bias added, n_group groups of which topk_group are kept by their two
  best scores, normalised when norm_topk_prob, times routed_scaling_factor; V2 softmax scores, topk_method
  greedy (one group) or group_limited_greedy (groups kept by their best score), times routed_scaling_factor
  and never normalised (transformers' V2 router ignores norm_topk_prob, so a config setting it, which DeepSeek's
  own code would follow, is refused). k goes up to topk_group * (experts per group).

The MoE half (dense first layers, shared experts, the V3 router, its largest k) is GLM-4.5's too
(glm4_moe.py), through this module's functions.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from moe_serve.exporters.base import ExportError, SafetensorsCheckpoint
from moe_serve.exporters.hf.family import HFFamily, layer_prefixes, register
from moe_serve.exporters.hf.reorder import latent_kv_rows, latent_q_rows
from moe_serve.layers.routers import RouterConfig, router_class, router_config
from moe_serve.layers.routers.grouped_topk import GroupedTopK, GroupedTopKConfig
from moe_serve.model_config import Activation, FFNConfig, LatentAttentionConfig, ModelConfig, RopeScaling


def first_dense_layers(hf: dict[str, Any]) -> tuple[int, ...]:
    """The MoE layers: every one from first_k_dense_replace on."""
    frequency = hf.get("moe_layer_freq", 1)
    if frequency != 1:
        raise ExportError(
            f"config.json: moe_layer_freq {frequency} is not supported (transformers' DeepSeek puts an MoE block in "
            "every layer from first_k_dense_replace on, which is moe_layer_freq 1)"
        )
    return tuple(range(hf.get("first_k_dense_replace") or 0, hf["num_hidden_layers"]))


def v3_router(hf: dict[str, Any]) -> RouterConfig:
    """DeepSeek-V3's router (GLM-4.5's too): sigmoid scores, a correction bias, groups kept by their two best."""
    return router_config(
        "grouped_topk",
        score="sigmoid",
        groups=hf.get("n_group") or 1,
        groups_kept=hf.get("topk_group") or 1,
        group_score="top2_sum",
        correction_bias=True,
        normalize=bool(hf.get("norm_topk_prob", True)),
        scale=float(hf.get("routed_scaling_factor", 2.5)),
    )


def reachable_k(hf: dict[str, Any], config: RouterConfig, num_experts: int) -> int:
    """The largest k the router reaches: every expert of the groups kept (requests past it are refused)."""
    assert isinstance(config, GroupedTopKConfig) and router_class(config.kind) is GroupedTopK
    reachable = GroupedTopK.reachable_k(config, num_experts)
    if hf["num_experts_per_tok"] > reachable:  # transformers would pick experts its mask removed
        raise ExportError(
            f"config.json: num_experts_per_tok {hf['num_experts_per_tok']} is beyond what its groups reach: "
            f"topk_group {config.groups_kept} of n_group {config.groups}, {num_experts // config.groups} experts each"
        )
    return reachable


def shared_experts(hf: dict[str, Any], activation: Activation) -> FFNConfig | None:
    """n_shared_experts experts of moe_intermediate_size, always on: one GLU of their total width."""
    count = hf.get("n_shared_experts") or 0
    return FFNConfig("glu", count * hf["moe_intermediate_size"], activation) if count else None


@register
class DeepSeekV2(HFFamily):
    name = "DeepSeek-V2"
    architectures = ("DeepseekV2ForCausalLM",)
    num_experts_keys = ("n_routed_experts",)
    expert_size_key = "moe_intermediate_size"
    attention_out_bias = True  # attention_bias puts a bias on q_a, kv_a and o_proj
    moe_prefix = "mlp"
    shared_expert_prefix = "mlp.shared_experts"
    defaults = {  # DeepseekV2Config's
        "n_shared_experts": 2,
        "first_k_dense_replace": 0,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 64,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "topk_method": "greedy",
        "max_position_embeddings": 2048,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "rms_norm_eps": 1e-6,
    }

    def rope_interleaved(self, hf: dict[str, Any]) -> bool:
        """Whether the checkpoint's rope rows hold interleaved pairs (V2: always)."""
        return True

    def moe_layers(self, hf: dict[str, Any]) -> tuple[int, ...]:
        return first_dense_layers(hf)

    def router(self, hf: dict[str, Any]) -> RouterConfig:
        method = hf.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ExportError(
                f"config.json: topk_method {method!r} is not supported for deepseek_v2 (transformers implements "
                "greedy and group_limited_greedy)"
            )
        if hf.get("norm_topk_prob"):
            raise ExportError(
                "config.json: norm_topk_prob true is not supported for deepseek_v2: transformers' DeepSeek-V2 router "
                "never normalises the chosen weights while DeepSeek's own code would, so neither can be matched to "
                "both"
            )
        grouped = method == "group_limited_greedy"
        return router_config(
            "grouped_topk",
            score="softmax",
            groups=hf["n_group"] if grouped else 1,
            groups_kept=hf["topk_group"] if grouped else 1,
            group_score="max",
            scale=float(hf.get("routed_scaling_factor", 1.0)),
        )

    def max_k(self, hf: dict[str, Any], num_experts: int) -> int:
        return reachable_k(hf, self.router(hf), num_experts)

    def shared_expert(self, hf: dict[str, Any], activation: Activation) -> FFNConfig | None:
        return shared_experts(hf, activation)

    def heads(self, hf: dict[str, Any], scaling: RopeScaling | None) -> dict[str, Any]:
        """The ModelConfig fields of latent attention: the MLA sizes, head_dim (the rope part the position tables
        cover), the heads' count for num_kv_heads (MLA has no key/value heads of its own), and the softmax scale.
        What else these configs may say that is not served is refused here, by name."""
        if hf.get("mlp_bias"):
            raise ExportError("config.json: mlp_bias true (biases on the dense and shared MLPs) is not supported")
        quantization = hf.get("quantization_config")
        if quantization:  # DeepSeek-V3 ships FP8 blocks with per-block scales (weight_scale_inv)
            method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
            raise ExportError(
                f"config.json: quantized DeepSeek checkpoints (quantization_config {method!r}) are not supported; "
                "export one in bf16 or fp32"
            )
        mla = LatentAttentionConfig(
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            q_lora_rank=hf.get("q_lora_rank"),
        )
        scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
        if scaling is not None and scaling.mscale_all_dim:  # transformers' yarn_apply_mscale
            mscale = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0
            scale *= mscale * mscale
        return {
            "latent_attention": mla,
            "head_dim": mla.qk_rope_head_dim,
            "num_kv_heads": hf["num_attention_heads"],
            "attention_scale": scale,
        }

    def attention_weights(
        self, checkpoint: SafetensorsCheckpoint, hf: dict[str, Any], config: ModelConfig, index: int
    ) -> dict[str, torch.Tensor]:
        """Layer `index`'s MLA tensors, their rope rows in the runtime's rotate-half order."""
        mla = config.latent_attention
        assert mla is not None
        src, dst = layer_prefixes(index)
        d, h = config.hidden_size, config.num_heads
        nope, rope, rank = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
        interleaved = self.rope_interleaved(hf)
        theirs, ours = src + "self_attn.", dst + "attn."
        out: dict[str, torch.Tensor] = {}

        def q_rows(weight: torch.Tensor) -> torch.Tensor:  # [H * (N + P), in]
            return latent_q_rows(weight, h, nope, rope) if interleaved else weight

        def kv_rows(tensor: torch.Tensor) -> torch.Tensor:  # [R + P, ...]
            return latent_kv_rows(tensor, rank) if interleaved else tensor

        q_out = h * (nope + rope)
        if mla.q_lora_rank is None:
            out[ours + "q_proj.weight"] = q_rows(checkpoint.get(theirs + "q_proj.weight", (q_out, d)))
        else:
            out[ours + "q_a_proj.weight"] = checkpoint.get(theirs + "q_a_proj.weight", (mla.q_lora_rank, d))
            if config.attention_bias:
                out[ours + "q_a_proj.bias"] = checkpoint.get(theirs + "q_a_proj.bias", (mla.q_lora_rank,))
            out[ours + "q_a_norm.weight"] = checkpoint.get(theirs + "q_a_layernorm.weight", (mla.q_lora_rank,))
            q_b = checkpoint.get(theirs + "q_b_proj.weight", (q_out, mla.q_lora_rank))
            out[ours + "q_b_proj.weight"] = q_rows(q_b)
        kv_a = checkpoint.get(theirs + "kv_a_proj_with_mqa.weight", (rank + rope, d))
        out[ours + "kv_a_proj.weight"] = kv_rows(kv_a)
        if config.attention_bias:
            out[ours + "kv_a_proj.bias"] = kv_rows(checkpoint.get(theirs + "kv_a_proj_with_mqa.bias", (rank + rope,)))
        out[ours + "kv_a_norm.weight"] = checkpoint.get(theirs + "kv_a_layernorm.weight", (rank,))
        out[ours + "kv_b_proj.weight"] = checkpoint.get(
            theirs + "kv_b_proj.weight", (h * (nope + mla.v_head_dim), rank)
        )
        out[ours + "o_proj.weight"] = checkpoint.get(theirs + "o_proj.weight", (d, h * mla.v_head_dim))
        if config.attention_out_bias:
            out[ours + "o_proj.bias"] = checkpoint.get(theirs + "o_proj.bias", (d,))
        return out


@register
class DeepSeekV3(DeepSeekV2):
    name = "DeepSeek-V3"
    architectures = ("DeepseekV3ForCausalLM",)
    aliases = ("Kimi K2",)  # released as DeepseekV3ForCausalLM: its config and tensors are V3's
    defaults = {  # DeepseekV3Config's
        "n_group": 8,
        "topk_group": 4,
        "n_shared_experts": 1,
        "first_k_dense_replace": 3,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "rope_interleave": True,
        "max_position_embeddings": 4096,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "rms_norm_eps": 1e-6,
    }

    def rope_interleaved(self, hf: dict[str, Any]) -> bool:
        """rope_interleave (DeepseekV3Config's default: true)."""
        return bool(hf.get("rope_interleave", True))

    def router(self, hf: dict[str, Any]) -> RouterConfig:
        return v3_router(hf)
