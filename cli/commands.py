"""One function per `moe-serve` command: parsed options in, output printed, exit status out. Heavy
modules are imported inside each command, so `moe-serve models` starts fast."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

from moe_serve.batch.options import BatchOptions
from moe_serve.cli.options import from_options, int_list
from moe_serve.config import EngineConfig, RequestLimits
from moe_serve.errors import ValidationError
from moe_serve.sampling_params import SamplingParams


def serve(args: argparse.Namespace) -> int:
    from moe_serve.server.app import create_app
    from moe_serve.server.http_server import build_server
    from moe_serve.server.settings import ServerSettings

    settings = from_options(
        ServerSettings,
        args,
        models=tuple(args.models),
        engine=from_options(EngineConfig, args),
        limits=from_options(RequestLimits, args),
    )
    logging.getLogger().setLevel(settings.log_level.upper())
    app = create_app(settings)
    logging.getLogger("moe_serve.server").info(
        "serving %s on http://%s:%d", ", ".join(app.state.ctx.models), settings.host, settings.port
    )
    build_server(app, settings).run()
    return 0


def generate(args: argparse.Namespace) -> int:
    from moe_serve.exporters.onnx.cache import load_servable
    from moe_serve.llm import LLM

    config = from_options(EngineConfig, args)
    llm = LLM(load_servable(args.model, config), config)
    outputs = llm.generate(args.prompt, from_options(SamplingParams, args))
    data = [
        {
            "prompt": o.prompt,
            "experts_per_token": o.experts_per_token,
            "completions": [
                {"text": c.text, "finish_reason": c.finish_reason, "num_tokens": len(c.token_ids)} for c in o.outputs
            ],
        }
        for o in outputs
    ]
    _emit(args, data, "\n\n".join(f"{o.prompt}{c.text}" for o in outputs for c in o.outputs))
    return 0


def classify(args: argparse.Namespace) -> int:
    return _pooling(
        args,
        lambda r: (
            f"{r.label}\t{r.probs[r.label]:.3f}\t(k={r.experts_per_token}{', approximate' if r.approximate else ''})"
        ),
    )


def score(args: argparse.Namespace) -> int:
    return _pooling(
        args,
        lambda r: (
            f"logprob {r.total_logprob:.3f}\ttokens {r.num_tokens}\t"
            f"bits/byte {r.bits_per_byte:.4f}\t(k={r.experts_per_token})"
        ),
    )


def _pooling(args: argparse.Namespace, describe: Any) -> int:
    """classify or score (args.command) each text; one line per text: describe(result), then the text."""
    from moe_serve.exporters.onnx.cache import load_servable
    from moe_serve.llm import LLM

    config = from_options(EngineConfig, args)
    llm = LLM(load_servable(args.model, config), config)
    results = getattr(llm, args.command)(args.texts, experts_per_token=args.experts_per_token)
    pairs = list(zip(args.texts, results, strict=True))
    _emit(
        args,
        [{"input": t, **dataclasses.asdict(r)} for t, r in pairs],
        "\n".join(f"{describe(r)}\t{t}" for t, r in pairs),
    )
    return 0


def batch(args: argparse.Namespace) -> int:
    from moe_serve.batch.runner import run_batch

    options = from_options(BatchOptions, args)
    if not options.input_path.is_file():
        raise ValidationError(f"input file {options.input} does not exist", parameter="input")
    ks = int_list(options.k, "k")
    engine_config = from_options(EngineConfig, args)
    runner = None
    if options.ray:
        from moe_serve.batch.ray import ray_chunk_runner

        runner = ray_chunk_runner(None if options.ray == "local" else options.ray, options.ray_workers, engine_config)
    summary, _ = run_batch(
        options.input_path,
        options.output_path,
        default_model=options.model,
        models=options.extra_models,
        ks=ks,
        engine_config=engine_config,
        chunk_size=options.chunk_size,
        progress=not args.json,
        chunk_runner=runner,
    )
    if options.quality:
        _write_batch_quality(options, ks)
    data = dataclasses.asdict(summary)
    data["tokens_per_s"] = (summary.prompt_tokens + summary.completion_tokens) / max(summary.seconds, 1e-9)
    data["requests_per_s"] = summary.requests / max(summary.seconds, 1e-9)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(
            f"{summary.lines} lines, {summary.requests} requests answered ({summary.skipped} already done), "
            f"{summary.errors} errors, {summary.prompt_tokens} prompt + {summary.completion_tokens} generated tokens "
            f"in {summary.seconds:.1f} s ({data['requests_per_s']:.1f} req/s, {data['tokens_per_s']:.0f} tok/s)",
            file=sys.stderr,
        )
        if summary.duplicates:
            print(f"duplicate custom_id (not run): {', '.join(summary.duplicates)}", file=sys.stderr)
    return 0


def _write_batch_quality(options: BatchOptions, ks: list[int] | None) -> None:
    from moe_serve.batch.jsonl import read_inputs
    from moe_serve.batch.quality import labels_of, quality_rows
    from moe_serve.registry import resolve_model

    labels = labels_of(read_inputs(options.input_path, ks=ks, allow_label=True))
    rows = quality_rows(options.output_path, options.input_path.stem, labels)
    for model in sorted({r.model or "" for r in rows}):
        mine = [r for r in rows if r.model == model]
        target = options.output_path.with_name(f"{options.output_path.stem}.{Path(model).name}.quality.json")
        targets = _quality_targets(resolve_model(model), target, options.write_artifact)
        _save_quality(mine, targets)
        for path in targets:
            print(f"wrote {len(mine)} quality rows for {model} to {path}", file=sys.stderr)


def _quality_targets(artifact: Path, target: Path, write_artifact: bool) -> list[Path]:
    """Where quality rows go: `target` and, when asked, the artifact's own quality.json (which the server
    exports). Checked before any work is done: a bundled demo's table is read-only data."""
    from moe_serve.quality import QUALITY_FILE
    from moe_serve.registry import is_bundled

    if not write_artifact:
        return [target]
    if is_bundled(artifact):
        raise ValidationError(
            f"{artifact.name} is a bundled demo: its quality table is read-only data", parameter="write_artifact"
        )
    return [target, artifact / QUALITY_FILE]


def _save_quality(rows: list, targets: list[Path]) -> None:
    from moe_serve.quality import QualityTable

    for path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        QualityTable(tuple(rows)).merge_into(path)


def _stored_quality(args: argparse.Namespace) -> int:
    """`moe-serve eval --stored`: each model's seed summary (provenance `seeds`) and those of the controls
    it carries (provenance `controls`), language models and classifiers in their own tables."""
    from moe_serve.artifact import read_manifest
    from moe_serve.evaluation.table import format_seed_table, stored_summaries
    from moe_serve.registry import bundled_models, resolve_model

    paths = {str(m): resolve_model(m) for m in args.models} if args.models else bundled_models()
    by_task: dict[str, dict[str, dict]] = {}
    for name, path in paths.items():
        manifest, config = read_manifest(path)
        provenance = manifest.get("provenance") or {}
        if not provenance.get("seeds"):
            if args.models:
                raise ValidationError(
                    f"{name} carries no figures over training seeds (its provenance has no 'seeds'; "
                    "recipes.build_demos writes them)",
                    parameter="models",
                )
            continue
        # The artifact's directory name, or what was given when two share it (runs/*/seed-*/artifact, say);
        # then the controls it carries (recipes without bundled weights), by their own names.
        unique = sum(other.name == path.name for other in paths.values()) == 1
        by_task.setdefault(config.task, {}).update(stored_summaries(path.name if unique else name, provenance))
    text = "\n".join(f"[{task}]\n{format_seed_table(summaries)}" for task, summaries in sorted(by_task.items()))
    if not by_task:
        text = "no bundled demo carries figures over training seeds yet (python -m recipes.build_demos writes them)"
    _emit(args, {"seeds": {t: s for t, s in sorted(by_task.items())}}, text)
    return 0


def evaluate(args: argparse.Namespace) -> int:
    from moe_serve.engine.backend import backend_for
    from moe_serve.evaluation.plot import plot
    from moe_serve.evaluation.runner import evaluate as run_eval
    from moe_serve.evaluation.table import format_table, write_csv
    from moe_serve.exporters.onnx.cache import load_servable
    from moe_serve.llm import LLM
    from moe_serve.moe_policy import MoEPolicy
    from moe_serve.quality import QUALITY_FILE

    if args.stored:
        return _stored_quality(args)
    if not args.models:
        raise ValidationError("name at least one MODEL to evaluate (or --stored)", parameter="models")
    requested = int_list(args.k, "k")
    policies = MoEPolicy.parse_sweep(args.moe) if args.moe else []
    output_dir = args.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    rows, written = [], {}
    config = from_options(EngineConfig, args)
    formats = _weight_formats(args.compare_weights, config)
    if args.write_artifact and backend_for(config).opens_onnx_exports:
        raise ValidationError(
            f"--write-artifact writes the artifact's quality.json, but --backend {config.backend} evaluates an "
            "export of it: evaluate with the torch backend to write the artifact's table",
            parameter="write_artifact",
        )
    for model in args.models:
        llm = LLM(load_servable(model, config), config)
        moe = llm.config.moe
        ks = requested or sorted(
            {k for k in (1, 2, 4, 8, 16, 32, 64) if moe and k <= moe.max_k} | {moe.max_k if moe else 1}
        )
        name = llm.artifact.name
        targets = _quality_targets(llm.artifact.path, output_dir / name / QUALITY_FILE, args.write_artifact)
        model_rows = run_eval(llm, ks, args.dataset, args.max_items, progress=not args.json, policies=policies)
        if formats:
            model_rows += _compare_weights(llm, model, config, formats, ks, args)
        _save_quality(model_rows, targets)
        written[name] = [str(t) for t in targets]
        rows += model_rows
    write_csv(output_dir / "quality.csv", rows)
    plot(output_dir / "quality_vs_k.png", rows)
    files = {
        "csv": str(output_dir / "quality.csv"),
        "png": str(output_dir / "quality_vs_k.png"),
        "quality_json": written,
    }
    paths = [files["csv"], files["png"], *(p for group in written.values() for p in group)]
    _emit(
        args,
        {"results": [r.to_dict() for r in rows], "files": files},
        format_table(rows) + "\n" + "\n".join(f"wrote {p}" for p in paths),
    )
    return 0


def _weight_formats(value: str | None, config: EngineConfig) -> list[str]:
    """--compare-weights' entries (FORMAT, or FORMAT:ACTIVATIONS), refused before anything runs where they cannot;
    as packed.weights_label names them."""
    from moe_serve.kernels import has_bf16_dot
    from moe_serve.kernels.packed import WEIGHTS_LABELS, WeightFormat, mode_reads, parse_weights_label, weights_label

    formats = []
    for entry in (f.strip() for f in value.split(",") if f.strip()) if value else ():
        parsed = parse_weights_label(entry)
        if parsed is None:
            raise ValidationError(
                f"--compare-weights takes {WEIGHTS_LABELS}; got {entry!r}", parameter="compare_weights"
            )
        if mode_reads(WeightFormat(parsed[0]), parsed[1]) == "bf16" and not has_bf16_dot():
            raise ValidationError(
                f"--compare-weights {entry}: bf16 activations need a CPU with AVX-512 BF16 (vdpbf16ps); this one "
                "would read fp32 ones",
                parameter="compare_weights",
            )
        formats.append(weights_label(*parsed))
    if formats and config.weights is not None:
        raise ValidationError(
            "--compare-weights compares packed formats with the float weights; drop --weights", parameter="weights"
        )
    if formats and (config.backend != "torch" or config.torch_device().type != "cpu"):
        raise ValidationError(
            "--compare-weights needs the torch backend on the CPU (packed weights run on the C++ CPU kernels): "
            "pass --backend torch --device cpu",
            parameter="compare_weights",
        )
    return formats


def _compare_weights(llm: Any, model: str, config: EngineConfig, formats: list[str], ks: list[int], args) -> list:
    """The model with its float weights packed in each format (loaded that way: EngineConfig.weights and
    cpu_activations): its rows at each k, the KL divergence of its next-token distributions from the floats',
    and for rounded activations (int8, bf16) from its format's with fp32 activations."""
    from moe_serve.evaluation.runner import evaluate as run_eval
    from moe_serve.evaluation.runner import weight_divergence
    from moe_serve.exporters.onnx.cache import load_servable
    from moe_serve.kernels.packed import parse_weights_label
    from moe_serve.llm import LLM

    if llm.artifact.weight_format is not None:
        raise ValidationError(
            f"--compare-weights packs float weights; {model} already stores {llm.artifact.weight_format} weights",
            parameter="compare_weights",
        )
    packed = {}
    rows = []

    parsed: dict[str, tuple[str, str]] = {label: parse_weights_label(label) for label in formats}  # type: ignore[misc]

    def load(fmt: str, activations: str) -> Any:
        packed_config = dataclasses.replace(config, weights=fmt, cpu_activations=activations)
        return LLM(load_servable(model, packed_config), packed_config)

    for label, (fmt, activations) in parsed.items():
        packed[label] = load(fmt, activations)
        rows += run_eval(packed[label], ks, args.dataset, args.max_items, progress=not args.json)
    rows += weight_divergence(llm, packed, ks, args.dataset, args.max_items)
    for label, (fmt, activations) in parsed.items():  # rounded activations against their format's fp32 ones
        if activations != "fp32":
            exact = packed[fmt] if fmt in packed else load(fmt, "fp32")
            rows += weight_divergence(
                exact, {label: packed[label]}, ks, args.dataset, args.max_items, metric="kl_from_fp32_activations"
            )
    return rows


def export(args: argparse.Namespace) -> int:
    from moe_serve.artifact import is_artifact_dir
    from moe_serve.exporters import exporter
    from moe_serve.exporters.base import ExportError, ExportOptions
    from moe_serve.exporters.dtypes import STORAGE_DTYPES
    from moe_serve.kernels.packed import WeightFormat
    from moe_serve.output_dir import check_destination

    # Before the conversion (minutes on a large checkpoint), not only when its result is written.
    sources = (Path(args.src),)
    check_destination(
        Path(args.dst), overwrite=args.overwrite, is_ours=is_artifact_dir, sources=sources, error=ExportError
    )
    options = ExportOptions(
        STORAGE_DTYPES[args.dtype] if args.dtype else None,
        not args.quiet,
        args.overwrite,
        weights=WeightFormat(args.weights) if args.weights else None,
    )
    path = exporter(args.format)(args.src, args.dst, options)
    print(f"wrote {path}")
    return 0


def quantize(args: argparse.Namespace) -> int:
    from moe_serve.quantize import quantize_artifact
    from moe_serve.registry import resolve_model

    path = quantize_artifact(
        resolve_model(args.model), args.dst, args.weights, overwrite=args.overwrite, progress=not args.quiet
    )
    print(f"wrote {path}")
    return 0


def export_onnx(args: argparse.Namespace) -> int:
    from moe_serve.exporters.onnx import export_onnx

    external = {"auto": None, "always": True, "never": False}[args.external_data]
    result = export_onnx(
        args.model, args.dst, external_data=external, overwrite=args.overwrite, verify=not args.no_verify
    )
    data = {
        "path": str(result.path),
        "files": list(result.files),
        "external_data": result.external_data,
        "max_abs_diff": result.max_abs_diff,
    }
    checked = "" if result.max_abs_diff is None else f"; onnxruntime vs torch max abs diff {result.max_abs_diff:.2g}"
    _emit(args, data, f"wrote {result.path} ({', '.join(result.files)}){checked}")
    return 0


def inspect(args: argparse.Namespace) -> int:
    from moe_serve.artifact import load_artifact
    from moe_serve.registry import resolve_model
    from moe_serve.summary import format_summary, summarize

    path = resolve_model(args.model)
    load_artifact(path)  # validates what `serve` validates: weights, tokenizer, checksums, template, quality
    summary = summarize(path)
    _emit(args, summary, format_summary(summary))
    return 0


def models(args: argparse.Namespace) -> int:
    from moe_serve.registry import bundled_models

    listing = {name: str(path) for name, path in bundled_models().items()}
    _emit(args, listing, "\n".join(f"{name}\t{path}" for name, path in listing.items()) or "no bundled models")
    return 0


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text)


COMMANDS = {
    "serve": serve,
    "generate": generate,
    "classify": classify,
    "score": score,
    "batch": batch,
    "eval": evaluate,
    "export": export,
    "quantize": quantize,
    "export-onnx": export_onnx,
    "inspect": inspect,
    "models": models,
}
