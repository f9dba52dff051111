"""Random-weight artifacts for tests, examples and benchmarks (no training involved)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moe_serve.artifact import save_artifact
from moe_serve.model_config import ModelConfig
from moe_serve.models import MoETransformer
from moe_serve.tokenizer import Tokenizer, byte_level_tokenizer


def random_state_dict(config: ModelConfig, seed: int = 0, std: float = 0.1) -> dict[str, torch.Tensor]:
    """Every tensor drawn from N(0, std), norm weights around 1, so routing and attention are non-trivial."""
    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = MoETransformer(config)
    state = {}
    for name, t in model.state_dict().items():
        values = torch.randn(t.shape, generator=generator) * std
        if "norm" in name and name.endswith("weight"):
            values = values + 1.0
        state[name] = values
    return state


def create_random_artifact(path: str | Path, config: ModelConfig, seed: int = 0, **save_kwargs: Any) -> Path:
    """Write a random-weight artifact with the byte-level tokenizer (vocab_size must be >= 257)."""
    provenance = {"exporter": "moe_serve.testing.create_random_artifact", "seed": seed}
    return save_artifact(
        path,
        config,
        random_state_dict(config, seed),
        Tokenizer(byte_level_tokenizer()),
        provenance=provenance,
        **save_kwargs,
    )
