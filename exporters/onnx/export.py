"""`moe-serve export-onnx MODEL OUT_DIR`: a serving artifact -> an ONNX graph with experts_per_token an
int64 input per row (docs/architecture.md §7; the interface is documented in moe_serve/onnx_model.py).

ONNX is an export *target*: the source is always a moe-serve artifact. The graph is traced from
exporters.onnx.graph with the TorchScript exporter (dynamo=False: the expert dispatch is data-dependent,
NonZero and ScatterND, which the tracer records as is), checked with `onnx.checker` (full check),
and, unless told not to, run once with onnxruntime on shapes other than the traced ones and compared
with the traced module, so a shape baked into the trace fails the export instead of a later request.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_serve.artifact import load_artifact, read_manifest, weights_spec
from moe_serve.exporters.base import ExportError
from moe_serve.exporters.onnx.graph import CausalLMGraph, ClassifierGraph, GraphModel
from moe_serve.layers.routers import router_class
from moe_serve.model_config import ModelConfig
from moe_serve.onnx_model import (
    CLASSIFIER_OUTPUTS,
    DATA_FILE,
    EXPERT_COUNTS,
    FORMAT,
    FORMAT_VERSION,
    GRAPH_FILE,
    INPUTS,
    META,
    OnnxModel,
    past_names,
    present_names,
)
from moe_serve.output_dir import check_destination, written_aside
from moe_serve.quality import QUALITY_FILE
from moe_serve.registry import resolve_model
from moe_serve.weights import packed_refusal

OPSET = 17
# Weights above this go to model.onnx.data beside the graph (protobuf cannot hold a file over 2 GiB).
EXTERNAL_DATA_BYTES = 1 << 30
# The exported graph against the traced module, on fresh shapes (fp32; both run the same math): the largest
# difference, relative to the largest output magnitude (at least 1). A baked-in shape is off by far more.
VERIFY_TOLERANCE = 1e-4


def is_onnx_dir(path: Path) -> bool:
    """Whether `path` is a directory an ONNX export made: its graph, its weights file, nothing else."""
    names = {entry.name for entry in path.iterdir()}
    return GRAPH_FILE in names and names <= {GRAPH_FILE, DATA_FILE} and not any(p.is_dir() for p in path.iterdir())


@dataclass(frozen=True, slots=True)
class OnnxExport:
    path: Path  # the output directory
    files: tuple[str, ...]  # what it holds
    external_data: bool  # weights in DATA_FILE
    max_abs_diff: float | None  # onnxruntime against the traced module on fresh shapes (None: not verified)


def check_exportable(config: ModelConfig) -> None:
    """Refuse, naming the feature, a model the graph cannot express (a router kind says for itself)."""
    if config.attention_features:
        raise ExportError(f"the ONNX export does not support {', '.join(config.attention_features)}")
    if config.moe is not None:
        refusal = router_class(config.moe.router.kind).onnx_refusal(config)
        if refusal is not None:
            raise ExportError(refusal)


def export_onnx(
    model: str | Path,
    dst: str | Path,
    *,
    external_data: bool | None = None,
    overwrite: bool = False,
    verify: bool = True,
    opset: int = OPSET,
) -> OnnxExport:
    """Export an artifact (a directory or a bundled demo name) to DST/model.onnx (+ DST/model.onnx.data when
    `external_data`, or when None and the weights exceed 1 GiB). DST is written aside and renamed into
    place, so a failed export leaves nothing behind."""
    for package in ("onnx", "onnxruntime") if verify else ("onnx",):
        if importlib.util.find_spec(package) is None:
            raise ExportError(f"export-onnx needs the {package} package: pip install 'moe-serve[onnx]'")
    src, dst = resolve_model(model), Path(dst)
    check_destination(
        dst, overwrite=overwrite, is_ours=is_onnx_dir, sources=(src,), what="an ONNX export", error=ExportError
    )
    manifest, config = read_manifest(src)
    spec = weights_spec(manifest, config, src)
    if spec is not None:
        raise ExportError(packed_refusal(spec, "the ONNX export"))
    check_exportable(config)  # before any weight is read
    artifact = load_artifact(src, dtype=torch.float32)
    graph: GraphModel = (CausalLMGraph if config.is_causal else ClassifierGraph)(artifact.model).eval()

    with written_aside(dst, ExportError) as tmp:
        trace_dir = tmp / "trace"  # the tracer's own output (it may split weights into files)
        trace_dir.mkdir()
        _trace(graph, trace_dir / GRAPH_FILE, opset)
        metadata = _metadata(config, artifact.tokenizer.hf.to_str(), src, manifest, opset)
        used_external = _finish(trace_dir / GRAPH_FILE, tmp / GRAPH_FILE, metadata, external_data)
        shutil.rmtree(trace_dir)
        max_diff = _verify(graph, tmp) if verify else None
        tmp.chmod(0o755)
    return OnnxExport(dst, tuple(sorted(p.name for p in dst.iterdir())), used_external, max_diff)


# ---- tracing --------------------------------------------------------------------------------------


def _example(config: ModelConfig, batch: int, new: int, past: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Inputs of the given shapes: random tokens, the first row left-padded by one, ks spread over the range."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (batch, new), generator=generator)
    mask = torch.ones(batch, past + new, dtype=torch.int64)
    if past + new > 1:
        mask[0, 0] = 0
    low, high = (config.moe.min_k, config.moe.max_k) if config.moe is not None else (1, 1)
    ks = torch.linspace(low, high, batch).round().long()
    if not config.is_causal:
        return input_ids, mask, ks
    assert config.num_kv_heads is not None and config.head_dim is not None  # completed by ModelConfig
    shape = (batch, config.num_kv_heads, past, config.head_dim)
    pasts = [torch.randn(shape, generator=generator) for _ in range(2 * config.num_layers)]
    return (input_ids, mask, ks, *pasts)


def _names(config: ModelConfig) -> tuple[list[str], list[str], dict[str, dict[int, str]]]:
    axes: dict[str, dict[int, str]] = {"experts_per_token": {0: "batch"}}
    counts = [EXPERT_COUNTS] if config.moe is not None else []  # [L_moe, N]: no dynamic axis
    if not config.is_causal:
        axes.update({name: {0: "batch", 1: "tokens"} for name in INPUTS[:2]})
        axes.update({name: {0: "batch"} for name in CLASSIFIER_OUTPUTS})
        return list(INPUTS), [*CLASSIFIER_OUTPUTS, *counts], axes
    pasts, presents = past_names(config.num_layers), present_names(config.num_layers)
    axes["input_ids"] = {0: "batch", 1: "new_tokens"}
    axes["attention_mask"] = {0: "batch", 1: "total_tokens"}
    axes["logits"] = {0: "batch", 1: "new_tokens"}
    axes.update({name: {0: "batch", 2: "past_tokens"} for name in pasts})
    axes.update({name: {0: "batch", 2: "total_tokens"} for name in presents})
    return [*INPUTS, *pasts], ["logits", *presents, *counts], axes


def _trace(graph: GraphModel, path: Path, opset: int) -> None:
    config = graph.config
    inputs, outputs, axes = _names(config)
    example = _example(config, batch=2, new=3, past=2 if config.is_causal else 0, seed=0)
    with warnings.catch_warnings(), torch.no_grad():
        # The TorchScript exporter warns that it is the legacy path, and about trace-time Python values
        # (the layer and expert loops, which are meant to unroll).
        warnings.simplefilter("ignore")
        torch.onnx.export(
            graph,
            example,
            str(path),
            dynamo=False,
            opset_version=opset,
            input_names=inputs,
            output_names=outputs,
            dynamic_axes=axes,
        )


# ---- metadata, weights, checks --------------------------------------------------------------------


def _metadata(config: ModelConfig, tokenizer_json: str, src: Path, manifest: dict, opset: int) -> dict[str, str]:
    moe = config.moe
    k_range = {"default": moe.default_k, "min": moe.min_k, "max": moe.max_k} if moe is not None else None
    values = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "task": config.task,
        "experts_per_token": json.dumps(k_range),
        "router": moe.router.kind if moe is not None else "none",
        "labels": json.dumps(list(config.classifier.labels) if config.classifier is not None else None),
        "config": json.dumps(config.to_dict()),
        "tokenizer": tokenizer_json,
        "provenance": json.dumps(
            {
                "exporter": "moe_serve.exporters.onnx",
                "source": src.name,
                "source_checksums": manifest.get("checksums", {}),
                "opset": opset,
                "torch": torch.__version__,
            }
        ),
    }
    if (src / QUALITY_FILE).is_file():  # served models show their quality against k
        values["quality"] = (src / QUALITY_FILE).read_text(encoding="utf-8")
    return {META + key: value for key, value in values.items()}


DOC = (
    "moe-serve export (experts_per_token: an int64 input per row). Token routers take the top K = max k "
    "slots; slots beyond a row's k get weight 0 and are never computed (each expert runs on the token slots "
    "routed to it). soft_merge merges all K slots' parameters, weight 0 beyond k."
)


def _finish(traced: Path, path: Path, metadata: dict[str, str], external_data: bool | None) -> bool:
    """Metadata in, weights inline or in DATA_FILE, then the full checker. -> whether the data is external."""
    import onnx

    proto = onnx.load(str(traced))  # also reads any weight files the tracer wrote beside it
    onnx.helper.set_model_props(proto, metadata)
    proto.doc_string = DOC
    proto.producer_name = "moe-serve"
    weight_bytes = sum(len(t.raw_data) for t in proto.graph.initializer)
    external = external_data if external_data is not None else weight_bytes > EXTERNAL_DATA_BYTES
    if external:
        onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=DATA_FILE)
    else:
        onnx.save_model(proto, str(path))
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"the exported graph fails onnx.checker: {exc}") from None
    return external


def _verify(graph: GraphModel, directory: Path) -> float:
    """onnxruntime on shapes the trace never saw (another batch, prompt and past length) against the
    traced module: the largest absolute difference of the outputs; ExportError above VERIFY_TOLERANCE
    times the largest output magnitude."""
    config = graph.config
    runner = OnnxModel(directory)
    worst = scale = 0.0
    # (rows, new tokens, past): a prompt, a decode step, a chunk after a past (chunked prefill).
    shapes = [(3, 5, 0), (1, 1, 4), (2, 4, 6)] if config.is_causal else [(3, 6, 0), (1, 1, 0)]
    for batch, new, past in shapes:
        example = _example(config, batch, new, past, seed=batch + new)
        with torch.no_grad():
            expected = graph(*example)
        got = runner.run({name: t.numpy() for name, t in zip(_names(config)[0], example, strict=True)})
        for want, have in zip(expected, got, strict=True):
            if not want.is_floating_point():  # expert_counts: a near-tie may route one slot apart, never more
                if int(want.sum()) != int(have.sum()):
                    raise ExportError(f"the graph's expert counts ({int(have.sum())}) differ from the model's")
                continue
            if want.numel():
                worst = max(worst, float((want - torch.from_numpy(have)).abs().max()))
                scale = max(scale, float(want.abs().max()))
    if worst > VERIFY_TOLERANCE * max(scale, 1.0):
        raise ExportError(
            f"onnxruntime differs from the traced model by {worst:.3g} (outputs up to {scale:.3g}) on shapes "
            "other than the traced ones; the trace baked in a shape"
        )
    return worst
