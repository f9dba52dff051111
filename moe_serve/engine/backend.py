"""Backends (EngineConfig.backend): what runs the model's forward pass behind the engine's Runner interface.
The scheduler, the KV-cache blocks, sampling, detokenizing and the server are the same for all of them.

- `torch`: the artifact's PyTorch model (moe_serve.engine.model_runner.TorchRunner).
- `onnxruntime`: an ONNX export of the model (moe_serve.engine.onnx_runner.OnnxRunner), fp32. MODEL is an
  export directory (`moe-serve export-onnx`) or an artifact / bundled demo, exported on first use into
  the cache (~/.cache/moe-serve/onnx, or $MOE_SERVE_ONNX_CACHE) under a key of its weights' checksums,
  and reused after. CUDAExecutionProvider when the device is CUDA and onnxruntime-gpu provides it, else
  CPUExecutionProvider. Per-token `moe` policies are torch-only (the graph takes one k per row).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from moe_serve.artifact import Artifact, load_artifact, read_manifest
from moe_serve.config import EngineConfig
from moe_serve.engine.kv_cache import CacheShape
from moe_serve.engine.model_runner import Runner, TorchRunner
from moe_serve.errors import ArtifactError, ValidationError
from moe_serve.exporters.base import ExportError
from moe_serve.quality import QUALITY_FILE, QualityTable
from moe_serve.registry import resolve_model

logger = logging.getLogger(__name__)


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
    from moe_serve.onnx_model import GRAPH_FILE, OnnxModel

    if config.dtype not in ("auto", "float32"):
        raise ValidationError(
            f"the onnxruntime backend runs fp32 graphs; dtype {config.dtype} is torch-only", parameter="dtype"
        )
    path = Path(model)
    quality = None
    if (path / GRAPH_FILE).is_file():  # an export directory
        name = path
    else:
        name = resolve_model(model)
        path = _exported(name)
        quality = QualityTable.read(name / QUALITY_FILE) if (name / QUALITY_FILE).is_file() else None
    graph = OnnxModel(path, providers=_providers(config))
    if quality is None and (path / QUALITY_FILE).is_file():
        quality = QualityTable.read(path / QUALITY_FILE)
    provenance = {"backend": "onnxruntime", "graph": str(path), "providers": graph.session.get_providers()}
    return Artifact(name, graph.config, graph.tokenizer, None, provenance, quality, onnx=graph)


def onnx_cache_dir() -> Path:
    return Path(os.environ.get("MOE_SERVE_ONNX_CACHE") or Path.home() / ".cache" / "moe-serve" / "onnx")


def _exported(src: Path) -> Path:
    """The cached export of an artifact, made on first use. The key is the artifact's recorded checksums
    (its weights, tokenizer and config) and the graph format: a changed artifact, or a runtime that needs
    another graph, gets a new export, never a stale one."""
    from moe_serve.exporters.onnx.export import export_onnx
    from moe_serve.onnx_model import FORMAT_VERSION

    manifest, _ = read_manifest(src)
    checksums = manifest.get("checksums") or {}
    if not checksums:
        raise ArtifactError(f"{src} records no checksums: its cached ONNX export could not be told from a stale one")
    source = {"checksums": checksums, "onnx_format_version": FORMAT_VERSION}
    key = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:16]
    dst = onnx_cache_dir() / f"{src.name}-{key}"
    if not dst.is_dir():
        logger.info("exporting %s to ONNX in %s (once; later starts reuse it)", src, dst)
        try:
            export_onnx(src, dst)  # written aside and renamed into place: a crash leaves no half export
        except (ExportError, OSError):
            if not dst.is_dir():  # not another process exporting the same artifact at the same time
                raise
    return dst


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
