"""Encoder classifiers (recipes/encoder.py) routed by MOESART, SMEAR, top-k or switch -> artifacts.

Formats:
- `moesart`: the temperature, the sampling path and the trimmed-lasso state are dropped (selection is
  top-k of the logits whatever tau is, and weights are exactly 1/k); router `topk_uniform` with bias.
- `smear`: the input-independent LayerNorm of the router weight is folded into the weight
  (W_eff[:, n] = LN_C(w_n)); the input LayerNorm stays as the router's input norm; the adapters (stored
  input-major with a leading num_routers = 1 dimension) become an `adapter` expert bank; `soft_merge`
  with a masked mean pool. Default k = N (exact SMEAR).
- `topk`: MOESART's top-k baseline (the fairseq fork's TopKGate, a linear gate with bias),
  `topk_softmax` normalize=true.
- `switch`: SMEAR's Top-k baseline: SMEAR's router and adapters folded as for `smear`; router
  `example_topk` (each example's argmax adapter scaled by p_max), trained k = 1.
Backbone: nn.MultiheadAttention's packed in_proj is split into q/k/v.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.nn import functional as F

from moe_serve.exporters.base import DEFAULT_OPTIONS, ExportError, ExportOptions, TrainingCheckpoint, write
from moe_serve.layers.routers import router_config
from moe_serve.model_config import ClassifierConfig, ExpertsPerToken, FFNConfig, ModelConfig, MoEConfig
from moe_serve.tokenizer import Tokenizer, byte_level_tokenizer

_SMEAR_FOLD = "router-weight LayerNorm folded into the router weight; adapters re-laid out [N, out, in]"
FOLDED = {
    "moesart": "temperature tau, sampling (Eq. 3 re-weighting) and trimmed-lasso state dropped; weights 1/k",
    "smear": _SMEAR_FOLD,
    "topk": "linear gate (with bias) kept as the router",
    "switch": _SMEAR_FOLD,  # SMEAR's router and adapters, routed per example by argmax x p_max
}


def convert_config(ckpt: TrainingCheckpoint, method: str) -> ModelConfig:
    n = ckpt.hyper("num_experts")
    if method == "smear":
        expert = FFNConfig("adapter", ckpt.hyper("d_expert"), "silu")
        router = router_config("soft_merge", input_norm="layernorm")
        k = ExpertsPerToken(default=n, min=1, max=n)  # soft_merge's own rule flags k < N
    elif method == "switch":  # SMEAR's router and adapters, each example's argmax adapter x p_max
        expert = FFNConfig("adapter", ckpt.hyper("d_expert"), "silu")
        router = router_config("example_topk", input_norm="layernorm")
        k = ExpertsPerToken(default=1, min=1, max=n, validated=(1,))
    else:
        expert = FFNConfig("mlp", ckpt.hyper("d_expert"), "relu", use_bias=True)
        router = router_config("topk_uniform" if method == "moesart" else "topk_softmax", use_bias=True)
        trained = ckpt.hyper("k")
        k = ExpertsPerToken(default=trained, min=1, max=n, validated=(trained,))
    layers = ckpt.hyper("n_layer")
    return ModelConfig(
        task="sequence_classification",
        vocab_size=ckpt.hyper("vocab_size"),
        hidden_size=ckpt.hyper("d_model"),
        num_layers=layers,
        num_heads=ckpt.hyper("n_head"),
        ffn=expert,  # every layer is an MoE layer; the dense FFN spec is unused
        moe=MoEConfig(n, tuple(range(layers)), expert, router, k),
        attention_bias=True,
        attention_out_bias=True,
        position="learned",
        max_position_embeddings=ckpt.hyper("max_len"),
        norm="layernorm",
        norm_eps=1e-5,
        norm_position="pre",
        classifier=ClassifierConfig(labels=tuple(ckpt.hyper("labels")), pooling="mean"),
    )


def convert_weights(ckpt: TrainingCheckpoint, config: ModelConfig, method: str) -> dict[str, torch.Tensor]:
    d = config.hidden_size
    assert config.moe is not None and config.classifier is not None
    n, f = config.moe.num_experts, config.moe.expert.intermediate_size
    out = {
        "embed_tokens.weight": ckpt.get("embed_tokens.weight", (config.vocab_size, d)),
        "embed_positions.weight": ckpt.get("embed_positions.weight", (config.max_position_embeddings, d)),
        "norm.weight": ckpt.get("norm.weight", (d,)),
        "norm.bias": ckpt.get("norm.bias", (d,)),
        "classifier.weight": ckpt.get("head.weight", (len(config.classifier.labels), d)),
        "classifier.bias": ckpt.get("head.bias", (len(config.classifier.labels),)),
    }
    for i in range(config.num_layers):
        src, dst = f"layers.{i}.", f"layers.{i}."
        q, k, v = ckpt.get(src + "self_attn.in_proj_weight", (3 * d, d)).chunk(3, dim=0)
        qb, kb, vb = ckpt.get(src + "self_attn.in_proj_bias", (3 * d,)).chunk(3, dim=0)
        for name, weight, bias in (("q_proj", q, qb), ("k_proj", k, kb), ("v_proj", v, vb)):
            out[dst + f"attn.{name}.weight"], out[dst + f"attn.{name}.bias"] = weight.contiguous(), bias.contiguous()
        out[dst + "attn.o_proj.weight"] = ckpt.get(src + "self_attn.out_proj.weight", (d, d))
        out[dst + "attn.o_proj.bias"] = ckpt.get(src + "self_attn.out_proj.bias", (d,))
        for ours, theirs in (("attn_norm", "norm1"), ("ffn_norm", "norm2")):
            out[dst + f"{ours}.weight"] = ckpt.get(src + f"{theirs}.weight", (d,))
            out[dst + f"{ours}.bias"] = ckpt.get(src + f"{theirs}.bias", (d,))
        moe_src, moe_dst = src + "moe.", dst + "moe."
        if method in ("smear", "switch"):
            out.update(_smear_layer(ckpt, moe_src + "adapter_controller.", moe_dst, n, d, f))
        else:
            gate = moe_src + ("gate.gate_weights." if method == "moesart" else "gate.layer.")
            if gate + "weight" not in ckpt:
                raise ExportError(f"missing key '{gate}weight': a {method} checkpoint has that gate in every MoE layer")
            out[moe_dst + "router.weight"] = ckpt.get(gate + "weight", (n, d))
            out[moe_dst + "router.bias"] = ckpt.get(gate + "bias", (n,))
            for name, shape, bias_shape in (("fc1", (f, d), (f,)), ("fc2", (d, f), (d,))):
                out[moe_dst + f"experts.{name}.weight"] = torch.stack(
                    [ckpt.get(f"{moe_src}experts.{e}.{name}.weight", shape) for e in range(n)]
                )
                out[moe_dst + f"experts.{name}.bias"] = torch.stack(
                    [ckpt.get(f"{moe_src}experts.{e}.{name}.bias", bias_shape) for e in range(n)]
                )
    return out


def _smear_layer(ckpt: TrainingCheckpoint, src: str, dst: str, n: int, d: int, m: int) -> dict[str, torch.Tensor]:
    if src + "multi_routers.router_weights" not in ckpt:
        raise ExportError(
            f"missing key '{src}multi_routers.router_weights': a SMEAR checkpoint has an adapter "
            f"controller in every MoE layer"
        )
    router = ckpt.get(src + "multi_routers.router_weights", (1, d, n))[0].float()  # [C, N] input-major
    gain = ckpt.get(src + "multi_routers.multi_router_weights_layer_norms.0.weight", (d,)).float()
    shift = ckpt.get(src + "multi_routers.multi_router_weights_layer_norms.0.bias", (d,)).float()
    adapters = src + "multi_adapters."
    return {
        # LayerNorm over C of each expert's router column, once: the router weight in [N, C] layout.
        dst + "router.weight": F.layer_norm(router.t(), (d,), gain, shift, 1e-5),
        dst + "router_norm.weight": ckpt.get(src + "multi_routers.multi_router_layer_norms.0.weight", (d,)),
        dst + "router_norm.bias": ckpt.get(src + "multi_routers.multi_router_layer_norms.0.bias", (d,)),
        dst + "experts.down.weight": ckpt.get(adapters + "down_samplers_weights", (1, n, d, m))[0]
        .transpose(1, 2)
        .contiguous(),
        dst + "experts.down.bias": ckpt.get(adapters + "down_samplers_bias", (1, n, m))[0],
        dst + "experts.up.weight": ckpt.get(adapters + "up_samplers_weights", (1, n, m, d))[0]
        .transpose(1, 2)
        .contiguous(),
    }


def export(fmt: str, src: str | Path, dst: str | Path, options: ExportOptions = DEFAULT_OPTIONS) -> Path:
    ckpt = TrainingCheckpoint(Path(src), fmt)
    config = convert_config(ckpt, fmt)
    state = convert_weights(ckpt, config, fmt)
    provenance = ckpt.provenance(f"exporters.genre_encoder ({fmt})", FOLDED[fmt] + "; in_proj split into q/k/v")
    return write(src, dst, config, state, Tokenizer(byte_level_tokenizer()), provenance, options)
