"""Tiny random Hugging Face MoE models built with transformers' own config and model classes."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from moe_serve.tokenizer import END_OF_TEXT, byte_level_tokenizer

NUM_EXPERTS = 8
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
# fmt: on


def build_hf_model(name: str, seed: int = 0, **overrides):
    model_class, make_config = MODELS[name]
    config = make_config()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # larger than HF's default init, so routing and logits are far from uniform
        for param_name, p in model.named_parameters():
            values = torch.randn(p.shape, generator=generator) * 0.15
            p.copy_(values + 1.0 if "norm" in param_name else values)
    return model


def save_hf_model(name: str, directory: Path, seed: int = 0, overrides: dict | None = None, **save_kwargs) -> Path:
    model = build_hf_model(name, seed, **(overrides or {}))
    model.save_pretrained(directory, **save_kwargs)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer(), eos_token=END_OF_TEXT)
    tokenizer.save_pretrained(directory)
    return directory
