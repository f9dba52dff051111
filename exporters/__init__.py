"""Checkpoint converters, offline only (`moe-serve export FORMAT SRC DST`); the runtime never imports them.

FORMATS is the registry: source format -> (module, function[, method]); adding a format is a module with
an `export(...)` function and a line here. ONNX is a target, not a source: `onnx/` (`moe-serve export-onnx`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from importlib import import_module
from pathlib import Path

FORMATS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "hf": ("hf", "export_hf", ()),
    "hyperrouter": ("transformer_xl", "export", ("hyperrouter",)),
    "smoe": ("transformer_xl", "export", ("smoe",)),
    "hypermoe": ("transformer_xl", "export", ("hypermoe",)),
    "similarity": ("transformer_xl", "export", ("similarity",)),
    "attention": ("transformer_xl", "export", ("attention",)),
    "txl-dense": ("transformer_xl", "export", ("txl-dense",)),
    "moesart": ("genre_encoder", "export", ("moesart",)),
    "smear": ("genre_encoder", "export", ("smear",)),
    "topk": ("genre_encoder", "export", ("topk",)),
    "switch": ("genre_encoder", "export", ("switch",)),
}


def exporter(fmt: str) -> Callable[..., Path]:
    """The export function of a source format: f(src, dst, *, dtype, progress, overwrite) -> artifact path."""
    module, function, args = FORMATS[fmt]
    return partial(getattr(import_module(f"moe_serve.exporters.{module}"), function), *args)
