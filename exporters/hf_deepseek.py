"""DeepSeek-V2 and DeepSeek-V3 (`deepseek_v2`, `deepseek_v3`) in `export hf`: what these families add to
exporters/hf.py's mapping, as transformers' modeling_deepseek_v2 / modeling_deepseek_v3 compute it in eval mode.

- Multi-head latent attention (ModelConfig.latent_attention, served by moe_serve/layers/latent_attention.py):
  q_proj, or q_a_proj / q_a_layernorm / q_b_proj (q_lora_rank); kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
  o_proj; attention_bias puts a bias on q_a, kv_a and o only, as transformers builds them. transformers rotates
  the rope dims as interleaved pairs (V2 always, through complex numbers; V3 when rope_interleave, its
  default); the export de-interleaves those rows of the q and kv_a projections (evens, then odds) so that the
  runtime's rotate-half rotary applies: V3's interleaved rotation is exactly rotate-half on the de-interleaved
  dims, and V2's rotated pairs are the same values in pair order, so every q . k is unchanged.
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
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import torch

from moe_serve.exporters.base import ExportError, SafetensorsCheckpoint
from moe_serve.layers.routers import RouterConfig, router_class, router_config
from moe_serve.layers.routers.grouped_topk import GroupedTopK, GroupedTopKConfig
from moe_serve.model_config import FFNConfig, LatentAttentionConfig, ModelConfig, RopeScaling

if TYPE_CHECKING:
    from moe_serve.exporters.hf import HFArchitecture

Version = Literal["v2", "v3"]


def moe_layers(hf: dict[str, Any]) -> tuple[int, ...]:
    frequency = hf.get("moe_layer_freq", 1)
    if frequency != 1:
        raise ExportError(
            f"config.json: moe_layer_freq {frequency} is not supported (transformers' DeepSeek puts an MoE block in "
            "every layer from first_k_dense_replace on, which is moe_layer_freq 1)"
        )
    return tuple(range(hf.get("first_k_dense_replace") or 0, hf["num_hidden_layers"]))


def router(hf: dict[str, Any], version: Version) -> RouterConfig:
    if version == "v3":
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
    method = hf.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ExportError(
            f"config.json: topk_method {method!r} is not supported for deepseek_v2 (transformers implements "
            "greedy and group_limited_greedy)"
        )
    if hf.get("norm_topk_prob"):
        raise ExportError(
            "config.json: norm_topk_prob true is not supported for deepseek_v2: transformers' DeepSeek-V2 router "
            "never normalises the chosen weights while DeepSeek's own code would, so neither can be matched to both"
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


def max_k(hf: dict[str, Any], config: RouterConfig, num_experts: int) -> int:
    """The largest k the router reaches: every expert of the groups kept (requests past it are refused)."""
    assert isinstance(config, GroupedTopKConfig) and router_class(config.kind) is GroupedTopK
    reachable = GroupedTopK.reachable_k(config, num_experts)
    if hf["num_experts_per_tok"] > reachable:  # transformers would pick experts its mask removed
        raise ExportError(
            f"config.json: num_experts_per_tok {hf['num_experts_per_tok']} is beyond what its groups reach: "
            f"topk_group {config.groups_kept} of n_group {config.groups}, {num_experts // config.groups} experts each"
        )
    return reachable


def shared_expert(hf: dict[str, Any], activation: str) -> FFNConfig | None:
    count = hf.get("n_shared_experts") or 0
    return FFNConfig("glu", count * hf["moe_intermediate_size"], activation) if count else None  # type: ignore[arg-type]


def model_fields(hf: dict[str, Any], scaling: RopeScaling | None) -> dict[str, Any]:
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


def interleaved_to_halves(n: int) -> torch.Tensor:
    """The order taking n rows holding rotary pairs (x0, x1), (x2, x3), ... to the evens, then the odds: rotary on
    halves, the convention moe-serve computes (DeepSeek's rope rows, Llama 4's q/k heads)."""
    return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])


def _deinterleave(rope_rows: torch.Tensor) -> torch.Tensor:
    return rope_rows[interleaved_to_halves(rope_rows.shape[0])]


def attention_weights(
    checkpoint: SafetensorsCheckpoint, hf: dict[str, Any], version: Version, config: ModelConfig, src: str, dst: str
) -> dict[str, torch.Tensor]:
    """One layer's MLA tensors (src: the checkpoint's `model.layers.{i}.`, dst: the artifact's `layers.{i}.`)."""
    mla = config.latent_attention
    assert mla is not None
    d, h = config.hidden_size, config.num_heads
    nope, rope, rank = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
    interleaved = version == "v2" or bool(hf.get("rope_interleave", True))
    theirs, ours = src + "self_attn.", dst + "attn."
    out: dict[str, torch.Tensor] = {}

    def q_rows(weight: torch.Tensor) -> torch.Tensor:  # [H * (N + P), in]: each head's rope rows de-interleaved
        if not interleaved:
            return weight
        heads = weight.view(h, nope + rope, -1)
        rope_part = torch.stack([_deinterleave(head[nope:]) for head in heads])
        return torch.cat([heads[:, :nope], rope_part], dim=1).reshape(weight.shape).contiguous()

    def kv_rows(tensor: torch.Tensor) -> torch.Tensor:  # [R + P, ...]: the shared rope rows de-interleaved
        return torch.cat([tensor[:rank], _deinterleave(tensor[rank:])]) if interleaved else tensor

    q_out = h * (nope + rope)
    if mla.q_lora_rank is None:
        out[ours + "q_proj.weight"] = q_rows(checkpoint.get(theirs + "q_proj.weight", (q_out, d)))
    else:
        out[ours + "q_a_proj.weight"] = checkpoint.get(theirs + "q_a_proj.weight", (mla.q_lora_rank, d))
        if config.attention_bias:
            out[ours + "q_a_proj.bias"] = checkpoint.get(theirs + "q_a_proj.bias", (mla.q_lora_rank,))
        out[ours + "q_a_norm.weight"] = checkpoint.get(theirs + "q_a_layernorm.weight", (mla.q_lora_rank,))
        out[ours + "q_b_proj.weight"] = q_rows(checkpoint.get(theirs + "q_b_proj.weight", (q_out, mla.q_lora_rank)))
    out[ours + "kv_a_proj.weight"] = kv_rows(checkpoint.get(theirs + "kv_a_proj_with_mqa.weight", (rank + rope, d)))
    if config.attention_bias:
        out[ours + "kv_a_proj.bias"] = kv_rows(checkpoint.get(theirs + "kv_a_proj_with_mqa.bias", (rank + rope,)))
    out[ours + "kv_a_norm.weight"] = checkpoint.get(theirs + "kv_a_layernorm.weight", (rank,))
    out[ours + "kv_b_proj.weight"] = checkpoint.get(theirs + "kv_b_proj.weight", (h * (nope + mla.v_head_dim), rank))
    out[ours + "o_proj.weight"] = checkpoint.get(theirs + "o_proj.weight", (d, h * mla.v_head_dim))
    if config.attention_out_bias:
        out[ours + "o_proj.bias"] = checkpoint.get(theirs + "o_proj.bias", (d,))
    return out


def layer_weights(
    checkpoint: SafetensorsCheckpoint, hf: dict[str, Any], arch: HFArchitecture, config: ModelConfig, index: int
) -> dict[str, torch.Tensor]:
    """Layer `index`'s tensors but its two norms (exporters.hf maps those): MLA, then a dense MLP or the router
    (with V3's correction bias), the experts and the shared experts, laid out as transformers saves them (the
    expert and MLP layouts through exporters.hf's own helpers)."""
    from moe_serve.exporters.hf import GLU_NAMES, _experts, _glu  # here: exporters.hf imports this module

    assert config.moe is not None and arch.deepseek is not None
    src, dst = f"model.layers.{index}.", f"layers.{index}."
    d, n = config.hidden_size, config.moe.num_experts
    out = attention_weights(checkpoint, hf, arch.deepseek, config, src, dst)
    if index not in config.moe.layers:
        return out | _glu(checkpoint, src + "mlp.", dst + "ffn.", GLU_NAMES, d, config.ffn.intermediate_size)
    out[dst + "moe.router.weight"] = checkpoint.get(src + "mlp.gate.weight", (n, d))
    router_settings = config.moe.router
    if isinstance(router_settings, GroupedTopKConfig) and router_settings.correction_bias:
        out[dst + "moe.router.correction_bias"] = checkpoint.get(src + "mlp.gate.e_score_correction_bias", (n,))
    out |= _experts(checkpoint, src + "mlp.", dst + "moe.experts.", arch, n, d, config.moe.expert.intermediate_size)
    shared = config.moe.shared_expert
    if shared is not None:
        size = shared.intermediate_size
        out |= _glu(checkpoint, src + "mlp.shared_experts.", dst + "moe.shared_expert.", GLU_NAMES, d, size)
    return out
