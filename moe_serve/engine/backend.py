"""Backends (EngineConfig.backend): what runs the model's forward pass behind the engine's Runner interface.
The scheduler, the KV-cache blocks, sampling, detokenizing and the server are the same for all of them.

- `torch`: the artifact's PyTorch model (moe_serve.engine.model_runner.TorchRunner).
- `onnxruntime`: an ONNX export of the model (moe_serve.engine.onnx_runner.OnnxRunner), fp32: MODEL is an
  export directory (`moe-serve export-onnx`; the command line and the server pass an artifact's cached
  export, moe_serve.exporters.onnx.cache, as the runtime never imports an exporter).
  CUDAExecutionProvider when the device is CUDA and onnxruntime-gpu provides it, else CPUExecutionProvider.
  Per-token `moe` policies are torch-only (the graph takes one k per row).
"""

from __future__ import annotations

from pathlib import Path

import torch

from moe_serve.artifact import Artifact, load_artifact
from moe_serve.config import EngineConfig
from moe_serve.engine.kv_cache import CacheShape
from moe_serve.engine.model_runner import Runner, TorchRunner
from moe_serve.errors import ArtifactError, ValidationError
from moe_serve.registry import resolve_model


def load_model(model: str | Path, config: EngineConfig) -> Artifact:
    """The model to serve (a directory or a bundled demo name), loaded for the configured backend."""
    if config.backend == "onnxruntime":
        return _load_onnx(model, config)
    return load_artifact(
        resolve_model(model),
        device=config.torch_device(),
        dtype=config.torch_dtype(),
        verify_checksums=config.verify_checksums,
    )


def engine_device(config: EngineConfig) -> torch.device:
    """Where the engine keeps its tensors (logits, sampling): onnxruntime hands results back on the host."""
    return torch.device("cpu") if config.backend == "onnxruntime" else config.torch_device()


def make_runner(artifact: Artifact, device: torch.device, shape: CacheShape) -> Runner:
    if artifact.onnx is not None:
        from moe_serve.engine.onnx_runner import OnnxRunner

        return OnnxRunner(artifact.onnx, shape)
    assert artifact.model is not None
    return TorchRunner(artifact.model, device, shape, model_dtype(artifact))


def model_dtype(artifact: Artifact) -> torch.dtype:
    """The dtype of the model's activations and KV cache (exported graphs are fp32)."""
    return torch.float32 if artifact.model is None else artifact.model.embed_tokens.weight.dtype


# ---- onnxruntime ------------------------------------------------------------------------------------


def _load_onnx(model: str | Path, config: EngineConfig) -> Artifact:
    from moe_serve.onnx_model import OnnxModel, is_export

    if config.dtype not in ("auto", "float32"):
        raise ValidationError(
            f"the onnxruntime backend runs fp32 graphs; dtype {config.dtype} is torch-only", parameter="dtype"
        )
    path = Path(model)
    if not is_export(path):
        raise ArtifactError(
            f"{model} is not an ONNX export: the onnxruntime backend runs `moe-serve export-onnx` directories "
            "(the command line and the server export an artifact on first use; in Python, "
            "moe_serve.exporters.onnx.cached_export(MODEL) returns the cached export)"
        )
    graph = OnnxModel(path, providers=_providers(config))
    provenance = {"backend": "onnxruntime", "graph": str(path), "providers": graph.session.get_providers()}
    return Artifact(path, graph.config, graph.tokenizer, None, provenance, graph.quality, onnx=graph)


def _providers(config: EngineConfig) -> list[str]:
    """CUDA where asked for (or, with device auto, where torch sees a GPU) and onnxruntime-gpu provides it."""
    import onnxruntime

    has_cuda = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    if config.device.startswith("cuda") and not has_cuda:
        raise ValidationError(
            f"device {config.device} with the onnxruntime backend needs onnxruntime's CUDAExecutionProvider "
            "(pip install onnxruntime-gpu); this onnxruntime has only "
            + ", ".join(onnxruntime.get_available_providers()),
            parameter="device",
        )
    if has_cuda and config.torch_device().type == "cuda":
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]
