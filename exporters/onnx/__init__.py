"""ONNX as an export *target* (docs/architecture.md §7): `moe-serve export-onnx MODEL OUT_DIR` turns a serving artifact
into one ONNX graph with experts_per_token an int64 input per row. graph.py is the traceable forward pass,
export.py the export, its refusals and checks, cache.py the exports `--backend onnxruntime` makes on first
use and `load_servable`, the front ends' way to load a model for any backend; moe_serve/onnx_model.py owns
the graph's interface and runs it with onnxruntime."""

from moe_serve.exporters.onnx.cache import cached_export, load_servable, servable
from moe_serve.exporters.onnx.export import OnnxExport, check_exportable, export_onnx

__all__ = ["OnnxExport", "cached_export", "check_exportable", "export_onnx", "load_servable", "servable"]
