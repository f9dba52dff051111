"""Recreate examples/tiny-moe: a random-weight Mixtral-style causal LM (byte tokenizer, 8 experts, k=2).

It only shows the commands working; its text is noise. Trained demo models come with the package.
Run: .venv/bin/python examples/make_tiny_moe.py
"""

from pathlib import Path

import torch

from moe_serve.model_config import ExpertsPerToken, FFNConfig, ModelConfig, MoEConfig, RouterConfig
from moe_serve.testing import create_random_artifact

CONFIG = ModelConfig(
    task="causal_lm",
    vocab_size=257,
    hidden_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    ffn=FFNConfig("glu", 128),
    moe=MoEConfig(
        num_experts=8,
        layers=(0, 1, 2, 3),
        expert=FFNConfig("glu", 96),
        router=RouterConfig("topk_softmax"),
        experts_per_token=ExpertsPerToken(default=2),
    ),
    position="rotary",
    max_position_embeddings=512,
    bos_token_id=256,
    eos_token_id=256,
    add_bos_token=True,
)

if __name__ == "__main__":
    out = Path(__file__).parent / "tiny-moe"
    create_random_artifact(out, CONFIG, seed=0, dtype=torch.bfloat16, overwrite=True)
    print(f"wrote {out}")
