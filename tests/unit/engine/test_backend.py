"""The backend table: one entry per configurable backend, and a loaded model the engine runs whoever loaded it."""

from __future__ import annotations

import torch

from moe_serve import LLM, SamplingParams
from moe_serve.artifact import Artifact
from moe_serve.config import BACKENDS, EngineConfig
from moe_serve.engine.backend import REGISTRY, engine_device, load_model
from tests.conftest import lm_config


def test_every_configurable_backend_has_one_entry() -> None:
    assert tuple(REGISTRY) == BACKENDS
    assert all(name == entry.name for name, entry in REGISTRY.items())
    assert engine_device(EngineConfig(backend="onnxruntime", device="cpu")) == torch.device("cpu")


def test_the_offline_api_runs_a_model_loaded_beforehand_as_it_runs_a_path(make_artifact) -> None:
    path = make_artifact(lm_config(), seed=3)
    config = EngineConfig(device="cpu")
    loaded = load_model(path, config)
    assert isinstance(loaded, Artifact) and loaded.dtype == torch.float32 and loaded.name == path.name
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    by_path, by_model = LLM(path, config), LLM(loaded, config)
    assert by_model.artifact is loaded
    assert (
        by_model.generate("ab", params)[0].outputs[0].token_ids
        == by_path.generate("ab", params)[0].outputs[0].token_ids
    )
