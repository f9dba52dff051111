"""ONNX exports made on first use, for `--backend onnxruntime` given an artifact or a bundled demo, and
`load_servable`, how the front ends (the command line, the server, the batch runner, the benchmarks) load a
model: the runtime's moe_serve.engine.backend.load_model, handed the artifact's cached export when the
backend opens exports. It lives here, not in the runtime, because the runtime never imports an exporter: it
only ever opens an export directory.

The cache is ~/.cache/moe-serve/onnx (or $MOE_SERVE_ONNX_CACHE), one directory per artifact under a key of
its recorded checksums and the graph format: a changed artifact, or a runtime that needs another graph,
gets a new export, never a stale one; later starts reuse it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from moe_serve.artifact import read_manifest
from moe_serve.config import EngineConfig
from moe_serve.engine.backend import backend_for, load_model
from moe_serve.engine.runner import LoadedModel
from moe_serve.errors import ArtifactError
from moe_serve.exporters.base import ExportError
from moe_serve.exporters.hf_cache import servable_artifact
from moe_serve.onnx_model import FORMAT_VERSION, is_export
from moe_serve.registry import resolve_model

logger = logging.getLogger(__name__)


def load_servable(model: str | Path, config: EngineConfig) -> LoadedModel:
    """The model (a directory or a bundled name) loaded for the configured backend, exported first if the
    backend opens ONNX exports and the model is an artifact."""
    return load_model(servable(model, config), config)


def servable(model: str | Path, config: EngineConfig) -> str:
    """What to load for the configured backend: the model as given, or, for a backend that opens ONNX
    exports and a moe-serve artifact (a directory or a bundled name), its cached export (made now if missing).
    A Hugging Face checkpoint (a directory, or a model id in the local hub cache) is exported to an artifact
    first, on first use (moe_serve.exporters.hf_cache)."""
    model = servable_artifact(model)
    if not backend_for(config).opens_onnx_exports or is_export(Path(model)):
        return str(model)
    return str(cached_export(model))


def cache_dir() -> Path:
    return Path(os.environ.get("MOE_SERVE_ONNX_CACHE") or Path.home() / ".cache" / "moe-serve" / "onnx")


def cached_export(model: str | Path) -> Path:
    """The export of an artifact (a directory or a bundled name) in the cache, made on first use."""
    from moe_serve.exporters.onnx.export import export_onnx  # torch.onnx: only when an export is needed

    src = resolve_model(model)
    manifest, _ = read_manifest(src)
    checksums = manifest.get("checksums") or {}
    if not checksums:
        raise ArtifactError(f"{src} records no checksums: its cached ONNX export could not be told from a stale one")
    source = {"checksums": checksums, "onnx_format_version": FORMAT_VERSION}
    key = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:16]
    dst = cache_dir() / key / src.name  # the export keeps the artifact's name: the served model's name
    if not dst.is_dir():
        logger.warning("exporting %s to ONNX in %s (once; later starts reuse it)", src, dst)
        try:
            export_onnx(src, dst)  # written aside and renamed into place: a crash leaves no half export
        except (ExportError, OSError):
            if not dst.is_dir():  # not another process exporting the same artifact at the same time
                raise
    return dst
