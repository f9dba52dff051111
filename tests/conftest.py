"""Shared fixtures: tiny random-weight configs and artifacts built inside the tests."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from moe_serve.layers.routers import router_config
from moe_serve.model_config import ClassifierConfig, ExpertsPerToken, FFNConfig, ModelConfig, MoEConfig
from moe_serve.testing import create_random_artifact

NUM_EXPERTS = 4

# The Triton kernels' tests run under Triton's interpreter, which must be switched on before any kernel is
# defined: in a pytest process of their own (`make test` runs `TRITON_INTERPRET=1 pytest tests/triton`).
collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["triton"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked gpu need a CUDA device: skipped, with the reason, where there is none (CI)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (make gpu-check runs these on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Builds the CPU kernels once, here, before any test starts a server process that would otherwise
    spend its startup deadline compiling them. ONNX exports made by `--backend onnxruntime` go to a
    directory of this run (server processes started by tests inherit it), never the user's cache."""
    from moe_serve.kernels import cpu_extension

    cpu_extension()
    os.environ["MOE_SERVE_ONNX_CACHE"] = tempfile.mkdtemp(prefix="moe-serve-onnx-test-")


def pytest_sessionfinish(session: pytest.Session) -> None:
    shutil.rmtree(os.environ.get("MOE_SERVE_ONNX_CACHE", ""), ignore_errors=True)


def free_port() -> int:
    """A free TCP port on the loopback interface (test servers listen on 127.0.0.1 only)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lm_config(**overrides) -> ModelConfig:
    """A baby causal LM: vocab 260 (byte tokenizer), hidden 32, 2 layers, MoE in layer 1, 4 experts, k=2."""
    moe = MoEConfig(
        num_experts=NUM_EXPERTS,
        layers=(1,),
        expert=FFNConfig("glu", 48),
        router=router_config("topk_softmax"),
        experts_per_token=ExpertsPerToken(default=2),
    )
    base = ModelConfig(
        task="causal_lm",
        vocab_size=260,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn=FFNConfig("mlp", 64, "gelu", use_bias=True),
        moe=moe,
        position="rotary",
        max_position_embeddings=256,
        bos_token_id=256,
        eos_token_id=256,
        add_bos_token=True,
    )
    return dataclasses.replace(base, **overrides)


def moe_config(**overrides) -> MoEConfig:
    return dataclasses.replace(lm_config().moe, **overrides)  # type: ignore[arg-type]


def classifier_config(**overrides) -> ModelConfig:
    base = lm_config(
        task="sequence_classification",
        position="learned",
        norm="layernorm",
        classifier=ClassifierConfig(labels=("comedy", "history", "tragedy"), pooling="mean"),
        moe=moe_config(
            expert=FFNConfig("adapter", 16, "silu"),
            router=router_config("soft_merge", input_norm="layernorm"),
            experts_per_token=ExpertsPerToken(default=NUM_EXPERTS),
        ),
        bos_token_id=None,
        eos_token_id=None,
        add_bos_token=False,
    )
    return dataclasses.replace(base, **overrides)


@pytest.fixture
def make_artifact(tmp_path: Path):
    counter = iter(range(10_000))

    def make(config: ModelConfig | None = None, seed: int = 0, **kwargs) -> Path:
        return create_random_artifact(
            tmp_path / f"artifact-{next(counter)}", config or lm_config(), seed=seed, **kwargs
        )

    return make
