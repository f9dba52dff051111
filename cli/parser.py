"""The one parser of `moe-serve` (docs/architecture.md §11): every command, its options derived from the config
dataclasses. Every command that reports data takes --json and then prints one JSON document."""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_serve.batch.options import BatchOptions
from moe_serve.cli.options import add_options, parse_k
from moe_serve.config import EngineConfig, RequestLimits
from moe_serve.exporters import FORMATS
from moe_serve.exporters.dtypes import STORAGE_DTYPES
from moe_serve.kernels.packed import PACKED_FORMAT_NAMES
from moe_serve.sampling_params import SamplingParams
from moe_serve.server.settings import ServerSettings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-serve", description="Serve Mixture-of-Experts models with per-request experts_per_token."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server (no MODEL: every bundled demo)")
    serve.add_argument("models", nargs="*", metavar="MODEL", help="artifact directories or bundled names")
    add_options(serve, ServerSettings)
    add_options(serve, EngineConfig)
    add_options(serve, RequestLimits)

    generate = commands.add_parser("generate", help="complete a prompt")
    _model_arguments(generate)
    generate.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    add_options(generate, SamplingParams)

    for name, help_text in (("classify", "classify texts"), ("score", "log-likelihood and bits per byte of texts")):
        sub = commands.add_parser(name, help=help_text)
        _model_arguments(sub)
        sub.add_argument("texts", nargs="+", metavar="TEXT")
        sub.add_argument(
            "--experts-per-token",
            "-k",
            type=parse_k,
            default=None,
            help='active experts per token, or "auto" (with --target-itl-ms) (default: the model\'s)',
        )

    batch = commands.add_parser("batch", help="OpenAI Batch JSONL in, results out (resumable, k sweeps)")
    batch.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_options(batch, BatchOptions)
    add_options(batch, EngineConfig)

    evaluate = commands.add_parser(
        "eval", help="quality against k on a held-out dataset (table, CSV, PNG, quality.json)"
    )
    evaluate.add_argument("models", nargs="*", metavar="MODEL")
    evaluate.add_argument(
        "--stored",
        action="store_true",
        help="print the MODELs' (default: every bundled demo's) figures over training seeds, as stored in "
        "their provenance by recipes.build_demos, side by side; evaluates nothing",
    )
    evaluate.add_argument(
        "--k", default=None, help="comma-separated k values (default: 1, 2, 4, ... up to the model's max)"
    )
    evaluate.add_argument(
        "--moe",
        default=None,
        metavar="top_p=P,P,...",
        help="also run each adaptive top-p policy (e.g. top_p=0.6,0.8,0.9), placed on the plot at its measured mean k",
    )
    evaluate.add_argument(
        "--compare-weights",
        default=None,
        metavar="FORMAT,...",
        help="also evaluate each MODEL with its float weights packed in these formats (bf16, int8, int4; FORMAT:MODE "
        "with --cpu-activations MODE: int8:int8, int4:int8, int8:auto, int4:auto, bf16:bf16, bf16:auto): the metric "
        "at each k, and for language models the KL divergence of next-token distributions from the floats "
        "(kl_from_float, nats per token) and, for rounded activations, from the format's with fp32 activations "
        "(kl_from_fp32_activations)",
    )
    evaluate.add_argument("--dataset", default="shakespeare")
    evaluate.add_argument(
        "--max-items",
        type=int,
        default=None,
        help="evaluate N windows or passages sampled evenly across the held-out plays (default: all)",
    )
    evaluate.add_argument(
        "--output-dir",
        type=Path,
        default=Path("eval-results"),
        help="where the table, CSV, PNG and each model's quality.json go",
    )
    evaluate.add_argument(
        "--write-artifact",
        action="store_true",
        help="also merge the results into each artifact's own quality.json (never a bundled demo's)",
    )
    evaluate.add_argument("--json", action="store_true")
    add_options(evaluate, EngineConfig)

    export = commands.add_parser("export", help="convert a training or Hugging Face checkpoint into an artifact")
    export.add_argument("format", choices=sorted(FORMATS), help="source format")
    export.add_argument("src", type=Path, help="source checkpoint directory")
    export.add_argument("dst", type=Path, help="artifact directory to write (written aside, then renamed)")
    export.add_argument(
        "--dtype", choices=sorted(STORAGE_DTYPES), default=None, help="storage dtype (default: as in the source)"
    )
    _weights_argument(export, required=False)
    export.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DST if it is an artifact or empty (never a folder holding SRC)",
    )
    export.add_argument("--quiet", action="store_true", help="no progress bar")

    quantize = commands.add_parser(
        "quantize", help="store an artifact's expert, attention and LM-head weights as bf16, int8 or int4"
    )
    quantize.add_argument("model", metavar="MODEL", help="artifact directory or bundled demo model name")
    quantize.add_argument(
        "dst", type=Path, metavar="OUT", help="artifact directory to write (written aside, then renamed)"
    )
    _weights_argument(quantize, required=True)
    quantize.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT if it is an artifact or empty (never a folder holding MODEL)",
    )
    quantize.add_argument("--quiet", action="store_true", help="no progress bar")

    onnx = commands.add_parser(
        "export-onnx", help="export an artifact to an ONNX graph with experts_per_token as an input per row"
    )
    onnx.add_argument("model", metavar="MODEL", help="artifact directory or bundled demo model name")
    onnx.add_argument("dst", type=Path, metavar="OUT_DIR", help="directory to write (written aside, then renamed)")
    onnx.add_argument(
        "--external-data",
        choices=("auto", "always", "never"),
        default="auto",
        help="weights in model.onnx.data beside the graph (auto: when they exceed 1 GiB)",
    )
    onnx.add_argument("--no-verify", action="store_true", help="skip running the graph with onnxruntime once")
    onnx.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    onnx.add_argument("--json", action="store_true")

    inspect = commands.add_parser("inspect", help="summarize an artifact: architecture, experts, k range, parameters")
    inspect.add_argument("model", metavar="MODEL")
    inspect.add_argument("--json", action="store_true")

    models = commands.add_parser("models", help="list the bundled demo models")
    models.add_argument("--json", action="store_true")
    return parser


def _weights_argument(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument(
        "--weights",
        choices=PACKED_FORMAT_NAMES,
        required=required,
        default=None,
        help="store the packable weights (experts, attention, dense FFNs, LM head) in this format: bf16, int8 "
        "or int4 with an fp16 scale per group of 32 (docs/artifact-format.md); served by the CPU kernels with "
        "float32 activations" + ("" if required else " (default: floats, as --dtype says)"),
    )


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="artifact directory or bundled demo model name")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    add_options(parser, EngineConfig)
