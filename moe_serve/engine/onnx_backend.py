"""The onnxruntime backend's loading (`--backend onnxruntime`, docs/architecture.md §7): what it opens (a `moe-serve
export-onnx` directory, never an artifact: the runtime does not import an exporter, so the front ends hand it
an artifact's cached export, moe_serve.exporters.onnx.cache), on which execution providers, at which dtype
(fp32 only), and the `ExportedModel` it serves. engine.onnx_runner runs its steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe_serve.config import EngineConfig
from moe_serve.errors import ArtifactError, ValidationError
from moe_serve.model_config import ModelConfig
from moe_serve.onnx_model import OnnxModel, is_export
from moe_serve.quality import QualityTable
from moe_serve.tokenizer import Tokenizer


@dataclass(slots=True)
class ExportedModel:
    """An ONNX export opened with onnxruntime, and what it carries: what the onnxruntime backend serves (an
    engine.runner.LoadedModel)."""

    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    graph: OnnxModel
    provenance: dict[str, Any]
    quality: QualityTable | None  # the source artifact's table, carried in the graph's metadata

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def dtype(self) -> torch.dtype:
        """Exported graphs are fp32."""
        return torch.float32

    @property
    def weight_format(self) -> str | None:
        return None  # the export refuses packed weights (moe_serve.weights.packed_refusal)

    @property
    def weights_label(self) -> str | None:
        return None


def load_export(model: str | Path, config: EngineConfig) -> ExportedModel:
    """Open an export directory (or graph file) for the configured device; refuse a dtype other than fp32."""
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
    return ExportedModel(path, graph.config, graph.tokenizer, graph, provenance, graph.quality)


def _providers(config: EngineConfig) -> list[str]:
    """CUDA where asked for (or, with device auto, where torch sees a GPU) and onnxruntime-gpu provides it."""
    import onnxruntime  # the `onnx` extra: imported only when a graph is opened

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
