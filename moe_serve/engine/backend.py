"""Backends (EngineConfig.backend): the table of what can run a model's forward pass, one entry per backend,
and `load_model`, the one function that turns a model name and an EngineConfig into what the engine runs.
The scheduler, the KV-cache blocks, sampling, detokenizing and the server are the same for all of them: the
engine sees a backend only through what it loaded (engine.runner.LoadedModel) and the runner that makes.

- `torch`: the artifact itself (moe_serve.artifact.Artifact), run by engine.model_runner.TorchRunner, at
  the configured device and dtype.
- `onnxruntime`: an ONNX export of the model (engine.onnx_backend.ExportedModel), run by
  engine.onnx_runner.OnnxRunner, fp32. CUDAExecutionProvider when the device is CUDA and onnxruntime-gpu
  provides it, else CPUExecutionProvider. Per-token `moe` policies are torch-only (the graph takes one k
  per row).

A backend that opens ONNX exports (`opens_onnx_exports`) is never handed an artifact by the runtime, which
does not import an exporter (tests/test_layout.py): the front ends load through
moe_serve.exporters.onnx.cache.load_servable, which exports an artifact to a cache on first use and then calls
`load_model` with the export. Passed explicitly rather than registered as a hook by the exporters package:
a hook would make `LLM(artifact, backend="onnxruntime")` export or refuse depending on whether anything in
the process had imported the exporters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from moe_serve.artifact import Artifact, load_artifact
from moe_serve.config import EngineConfig
from moe_serve.engine.kv_cache import CacheShape
from moe_serve.engine.model_runner import TorchRunner
from moe_serve.engine.onnx_backend import ExportedModel, load_export
from moe_serve.engine.onnx_runner import OnnxRunner
from moe_serve.engine.runner import LoadedModel, Runner
from moe_serve.kernels.packed import WeightFormat
from moe_serve.registry import resolve_model

M = TypeVar("M", bound=LoadedModel)  # what a backend loads


@dataclass(frozen=True, slots=True)
class Backend(Generic[M]):
    """One backend: how it loads a model, the runner it runs the loaded model's steps with, and where the
    engine keeps its tensors. The runner computes at the dtype the loaded model reports (LoadedModel.dtype)."""

    name: str  # EngineConfig.backend
    load: Callable[[str | Path, EngineConfig], M]  # the model named, per the config (dtype rules here)
    # The runner of the loaded model's steps, with a KV cache of the given shape (on the device, where the
    # backend uses it), run as the config says (CUDA graphs, the largest batch).
    make_runner: Callable[[M, torch.device, CacheShape, EngineConfig], Runner]
    device: Callable[[EngineConfig], torch.device]  # where the engine keeps its tensors (logits, sampling)
    opens_onnx_exports: bool  # given an artifact, the front ends export it first (exporters.onnx.cache)


def _load_torch(model: str | Path, config: EngineConfig) -> Artifact:
    return load_artifact(
        resolve_model(model),
        device=config.torch_device(),
        dtype=config.torch_dtype(),
        verify_checksums=config.verify_checksums,
        pack_as=WeightFormat(config.weights) if config.weights else None,
        cpu_activations=config.cpu_activations,
    )


def _torch_runner(artifact: Artifact, device: torch.device, shape: CacheShape, config: EngineConfig) -> Runner:
    return TorchRunner(artifact.model, device, shape, artifact.dtype, config)


def _onnx_runner(export: ExportedModel, device: torch.device, shape: CacheShape, config: EngineConfig) -> Runner:
    # `device` is unused: the execution providers were chosen when the graph was opened, and onnxruntime
    # hands results back on the host (the backend's device).
    return OnnxRunner(export.graph, shape)


REGISTRY: dict[str, Backend[Any]] = {
    backend.name: backend
    for backend in (
        Backend("torch", _load_torch, _torch_runner, EngineConfig.torch_device, opens_onnx_exports=False),
        # onnxruntime hands results back on the host.
        Backend("onnxruntime", load_export, _onnx_runner, lambda config: torch.device("cpu"), opens_onnx_exports=True),
    )
}


def backend_for(config: EngineConfig) -> Backend:
    return REGISTRY[config.backend]


def make_runner(loaded: LoadedModel, device: torch.device, shape: CacheShape, config: EngineConfig) -> Runner:
    """The runner of a loaded model's steps, by the configured backend (the one that loaded it)."""
    return backend_for(config).make_runner(loaded, device, shape, config)


def load_model(model: str | Path, config: EngineConfig) -> LoadedModel:
    """The model to serve (a directory or a bundled demo name), loaded for the configured backend."""
    return backend_for(config).load(model, config)


def engine_device(config: EngineConfig) -> torch.device:
    """Where the engine keeps its tensors (logits, sampling)."""
    return backend_for(config).device(config)
