"""Tiny random Hugging Face MoE models built with transformers' own config and model classes."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    GraniteMoeConfig,
    GraniteMoeForCausalLM,
    GraniteMoeSharedConfig,
    GraniteMoeSharedForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    PhimoeConfig,
    PhimoeForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from moe_serve.tokenizer import END_OF_TEXT, byte_level_tokenizer

NUM_EXPERTS = 8


def _longrope(head_dim: int) -> dict:
    """Phi-3.5's rotary scaling, with made-up factors (one per frequency) and mscales."""
    steps = torch.linspace(1.0, 4.0, head_dim // 2)
    return {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": LONGROPE_ORIGINAL,
            "factor": 4.0,
            "short_factor": steps.tolist(), "long_factor": (steps * 2).tolist(), "short_mscale": 1.2,
            "long_mscale": 1.35}  # fmt: skip


# fmt: off
COMMON = dict(vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}

MODELS = {
    "mixtral": (MixtralForCausalLM, lambda: MixtralConfig(
        **COMMON, intermediate_size=96, num_hidden_layers=2, num_local_experts=NUM_EXPERTS, num_experts_per_tok=2)),
    "qwen2_moe": (Qwen2MoeForCausalLM, lambda: Qwen2MoeConfig(
        **COMMON, intermediate_size=112, moe_intermediate_size=48, shared_expert_intermediate_size=80,
        num_hidden_layers=4, num_experts=NUM_EXPERTS, num_experts_per_tok=4, decoder_sparse_step=1,
        mlp_only_layers=[2], norm_topk_prob=False)),
    "qwen3_moe": (Qwen3MoeForCausalLM, lambda: Qwen3MoeConfig(
        **COMMON, intermediate_size=112, moe_intermediate_size=48, num_hidden_layers=3, num_experts=NUM_EXPERTS,
        num_experts_per_tok=2, head_dim=24, norm_topk_prob=True, decoder_sparse_step=2, max_position_embeddings=128,
        rope_parameters=YARN)),
    "olmoe": (OlmoeForCausalLM, lambda: OlmoeConfig(
        **COMMON, intermediate_size=48, num_hidden_layers=2, num_experts=NUM_EXPERTS, num_experts_per_tok=2,
        clip_qkv=3.0)),
}
# Phi-3.5-MoE and Granite-MoE (tests/exporters/test_hf_families.py): transformers' Phi router ignores
# num_experts_per_tok (it always takes two steps), so these are tested at k apart from MODELS.
LONGROPE_ORIGINAL = 128  # Phi's longrope serves its short regime, positions below this (exported as the context)
FAMILIES = {
    # Phi-3.5-MoE's conventions: LayerNorm with bias, biases on q/k/v/o and the LM head, longrope rotary with
    # distinct short/long factors and mscales; a jitter threshold wide enough that sparsemixer's masked
    # softmaxes hold several experts (Phi ships 0.01, where nearly every weight is 1).
    "phimoe": (PhimoeForCausalLM, lambda: PhimoeConfig(
        **COMMON, intermediate_size=48, num_hidden_layers=2, num_local_experts=NUM_EXPERTS, num_experts_per_tok=2,
        attention_bias=True, lm_head_bias=True, router_jitter_noise=0.3, max_position_embeddings=512,
        rope_parameters=_longrope(head_dim=16))),
    # Granite's multipliers, each away from 1 (and attention's from 1/sqrt(head_dim)).
    "granitemoe": (GraniteMoeForCausalLM, lambda: GraniteMoeConfig(
        **COMMON, intermediate_size=48, num_hidden_layers=2, num_local_experts=NUM_EXPERTS, num_experts_per_tok=2,
        embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.1, logits_scaling=2.5)),
    "granitemoeshared": (GraniteMoeSharedForCausalLM, lambda: GraniteMoeSharedConfig(
        **COMMON, intermediate_size=40, shared_intermediate_size=56, num_hidden_layers=2,
        num_local_experts=NUM_EXPERTS, num_experts_per_tok=3, embedding_multiplier=2.0, residual_multiplier=0.6,
        attention_multiplier=0.3, logits_scaling=1.5)),
    # gpt-oss's conventions: sliding-window layers (a window of 8, shorter than the 36 tokens tested) between
    # full ones, attention sinks, biases on q/k/v/o, router and experts, yarn rotary without truncation, and a
    # SwiGLU limit low enough that its clamps act on these weights.
    "gpt_oss": (GptOssForCausalLM, lambda: GptOssConfig(
        **COMMON, intermediate_size=64, head_dim=16, num_hidden_layers=4, num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.0, max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={**YARN, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0},
        tie_word_embeddings=False)),
    # Mixtral with a sliding window (of 8, shorter than the 36 tokens tested): every layer slides, so blocks
    # leaving the window are given back.
    "mixtral_window": (MixtralForCausalLM, lambda: MixtralConfig(
        **COMMON, intermediate_size=96, num_hidden_layers=2, num_local_experts=NUM_EXPERTS, num_experts_per_tok=2,
        sliding_window=8, max_position_embeddings=512)),
    # GLM-4.5's conventions: DeepSeek-V3's router (sigmoid, a correction bias, 2 of 4 groups kept, a routing
    # scale), a dense first layer and a shared expert, biases on q/k/v, per-head q/k norms and partial rotary
    # (half of each head's dims rotate).
    "glm4_moe": (Glm4MoeForCausalLM, lambda: Glm4MoeConfig(
        **COMMON, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        n_routed_experts=NUM_EXPERTS, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
        n_shared_experts=1, routed_scaling_factor=1.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # Llama 4's conventions: MoE on alternate layers beside dense ones, a shared expert, the sigmoid router
    # scaling the expert's input, local chunks of 8 (36 tokens tested) on the rotary layers with the L2 q/k
    # norm, a global layer without rotary with temperature tuning (a floor_scale small enough to vary), llama3
    # rotary scaling on interleaved pairs.
    "llama4": (Llama4ForCausalLM, lambda: Llama4TextConfig(
        **COMMON, head_dim=16, intermediate_size=48, intermediate_size_mlp=80, num_hidden_layers=4,
        num_local_experts=NUM_EXPERTS, num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=8,
        no_rope_layers=[1, 1, 1, 0], use_qk_norm=True, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1,
        max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
}
# fmt: on
ALL = {**MODELS, **FAMILIES}


def build_hf_model(name: str, seed: int = 0, **overrides):
    model_class, make_config = ALL[name]
    config = make_config()
    for key, value in overrides.items():
        setattr(config, key, value)
    if config.rope_parameters.get("rope_type") == "longrope":  # one factor per frequency of the head size
        config.rope_parameters = _longrope(config.hidden_size // config.num_attention_heads)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # larger than HF's default init, so routing and logits are far from uniform
        for param_name, p in model.named_parameters():
            values = torch.randn(p.shape, generator=generator) * 0.15
            p.copy_(values + 1.0 if "norm" in param_name and param_name.endswith("weight") else values)
    return model


def save_hf_model(name: str, directory: Path, seed: int = 0, overrides: dict | None = None, **save_kwargs) -> Path:
    model = build_hf_model(name, seed, **(overrides or {}))
    model.save_pretrained(directory, **save_kwargs)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer(), eos_token=END_OF_TEXT)
    tokenizer.save_pretrained(directory)
    return directory
