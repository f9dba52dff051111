"""The runtime's commands of `moe-serve` (DESIGN §11): generate, classify, score, eval, inspect, models.
`server.cli` adds `serve` (the console script's entry point), so this package never imports the server.
Every command that reports data takes --json and then prints one JSON document on stdout."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moe_serve.errors import MoEServeError


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="artifact directory or bundled demo model name")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda")
    parser.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-serve", description="Serve Mixture-of-Experts models with per-request experts_per_token.")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="complete a prompt")
    _add_model_args(generate)
    generate.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--experts-per-token", "-k", type=int, default=None, help="active experts per token (default: the model's)")
    generate.add_argument("--temperature", type=float, default=0.8)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("-n", type=int, default=1, help="completions per prompt")

    for name, help_text in (("classify", "classify texts"), ("score", "log-likelihood and bits per byte of texts")):
        sub = commands.add_parser(name, help=help_text)
        _add_model_args(sub)
        sub.add_argument("texts", nargs="+", metavar="TEXT")
        sub.add_argument("--experts-per-token", "-k", type=int, default=None)

    evaluate = commands.add_parser("eval", help="quality against k on a held-out dataset (table, CSV, PNG, quality.json)")
    evaluate.add_argument("models", nargs="+", metavar="MODEL")
    evaluate.add_argument("--k", default=None, help="comma-separated k values (default: 1, 2, 4, ... up to the model's max)")
    evaluate.add_argument("--dataset", default="shakespeare")
    evaluate.add_argument("--max-items", type=int, default=None, help="evaluate N windows or passages sampled evenly across the held-out plays (default: all)")
    evaluate.add_argument("--output-dir", type=Path, default=Path("eval-results"), help="where the CSV and PNG go")
    evaluate.add_argument("--device", default="auto")
    evaluate.add_argument("--json", action="store_true")

    inspect = commands.add_parser("inspect", help="summarize an artifact: architecture, experts, k range, parameters")
    inspect.add_argument("model", metavar="MODEL")
    inspect.add_argument("--json", action="store_true")

    models = commands.add_parser("models", help="list the bundled demo models")
    models.add_argument("--json", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_command(args)


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed command; errors the user can fix print one line and exit with status 2."""
    try:
        return _run(args)
    except MoEServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "models":
        from moe_serve.registry import bundled_models

        models = {name: str(path) for name, path in bundled_models().items()}
        _emit(args, models, "\n".join(f"{name}\t{path}" for name, path in models.items()) or "no bundled models")
        return 0
    if args.command == "inspect":
        from moe_serve.inspect import format_summary, summarize
        from moe_serve.registry import resolve_model

        summary = summarize(resolve_model(args.model))
        _emit(args, summary, format_summary(summary))
        return 0

    if args.command == "eval":
        return _eval(args)

    from moe_serve import LLM, SamplingParams

    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    if args.command == "generate":
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
            n=args.n,
            experts_per_token=args.experts_per_token,
        )
        outputs = llm.generate(args.prompt, params)
        data = [
            {"prompt": o.prompt, "experts_per_token": o.experts_per_token,
             "completions": [{"text": c.text, "finish_reason": c.finish_reason, "num_tokens": len(c.token_ids)} for c in o.outputs]}
            for o in outputs
        ]
        text = "\n\n".join(f"{o.prompt}{c.text}" for o in outputs for c in o.outputs)
    elif args.command == "classify":
        results = llm.classify(args.texts, experts_per_token=args.experts_per_token)
        data = [{"input": t, **dataclasses.asdict(r)} for t, r in zip(args.texts, results)]
        text = "\n".join(
            f"{r.label}\t{r.probs[r.label]:.3f}\t(k={r.experts_per_token}{', approximate' if r.approximate else ''})\t{t}"
            for t, r in zip(args.texts, results)
        )
    else:
        results = llm.score(args.texts, experts_per_token=args.experts_per_token)
        data = [{"input": t, **dataclasses.asdict(r)} for t, r in zip(args.texts, results)]
        text = "\n".join(
            f"logprob {r.total_logprob:.3f}\ttokens {r.num_tokens}\tbits/byte {r.bits_per_byte:.4f}\t(k={r.experts_per_token})\t{t}"
            for t, r in zip(args.texts, results)
        )
    _emit(args, data, text)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from moe_serve import LLM
    from moe_serve.errors import ValidationError
    from moe_serve.evaluation import evaluate, format_table, plot, quality_path, write_csv, write_quality

    try:
        requested = [int(k) for k in args.k.split(",")] if args.k else None
    except ValueError:
        raise ValidationError(f"--k must be comma-separated integers, got {args.k!r}", parameter="k") from None
    args.output_dir.mkdir(parents=True, exist_ok=True)
    rows, written = [], {}
    for model in args.models:
        llm = LLM(model, device=args.device)
        moe = llm.config.moe
        ks = requested or sorted({k for k in (1, 2, 4, 8, 16, 32, 64) if moe and k <= moe.max_k} | {moe.max_k if moe else 1})
        model_rows = evaluate(llm, ks, args.dataset, args.max_items, progress=not args.json)
        target = quality_path(llm.artifact.path, args.output_dir)
        write_quality(target, model_rows)
        written[llm.artifact.name] = str(target)
        rows += model_rows
    write_csv(args.output_dir / "quality.csv", rows)
    plot(args.output_dir / "quality_vs_k.png", rows)
    files = {"csv": str(args.output_dir / "quality.csv"), "png": str(args.output_dir / "quality_vs_k.png"), "quality_json": written}
    text = format_table(rows) + "\n" + "\n".join(f"wrote {p}" for p in [files["csv"], files["png"], *written.values()])
    _emit(args, {"results": rows, "files": files}, text)
    return 0


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text)


if __name__ == "__main__":
    sys.exit(main())
