"""The `moe-serve` console script: the runtime's commands (moe_serve.cli) plus `serve` and `batch`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from moe_serve.cli import build_parser, run_command


def add_serve_command(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server (no MODEL: every bundled demo)")
    serve.add_argument("models", nargs="*", metavar="MODEL")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1/* (env MOE_SERVE_API_KEY)")
    serve.add_argument("--max-tokens-cap", type=int, default=4096)
    serve.add_argument("--max-num-seqs", type=int, default=32, help="sequences per step (KV-cache slots)")
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--kv-cache-tokens", type=int, default=None, help="KV-cache budget in tokens (prompt + max_tokens per request)")
    serve.add_argument("--max-waiting", type=int, default=256, help="queued requests per model before 429")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20)
    serve.add_argument("--expert-metrics", choices=("full", "summary", "off"), default="full")
    serve.add_argument("--device", default="auto")
    serve.add_argument("--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for in-flight requests")
    serve.add_argument("--log-level", default="info")


def add_batch_command(commands: argparse._SubParsersAction) -> None:
    batch = commands.add_parser("batch", help="OpenAI Batch JSONL in, results out (resumable, k sweeps)")
    batch.add_argument("-i", "--input", type=Path, required=True, help="OpenAI Batch JSONL file")
    batch.add_argument("-o", "--output", type=Path, required=True, help="results JSONL (appended; a rerun resumes)")
    batch.add_argument("--model", default=None, help="default model (a line's body.model wins)")
    batch.add_argument("--k", default=None, help="comma-separated experts_per_token sweep: every line answered once per k")
    batch.add_argument("--chunk-size", type=int, default=64, help="requests per batched engine call")
    batch.add_argument("--max-num-seqs", type=int, default=64)
    batch.add_argument("--device", default="auto")
    batch.add_argument("--quality", action="store_true", help="write accuracy / bits-per-byte vs k into each model's quality.json")
    batch.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS", help="shard over a Ray cluster (no ADDRESS: a local Ray)")
    batch.add_argument("--ray-workers", type=int, default=2)
    batch.add_argument("--json", action="store_true", help="print the summary as JSON")


def batch(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from moe_serve.config import EngineConfig
    from moe_serve.errors import ValidationError
    from server.batch import run_batch

    if not args.input.is_file():
        raise ValidationError(f"input file {args.input} does not exist", parameter="input")
    try:
        ks = [int(k) for k in args.k.split(",")] if args.k else None
    except ValueError:
        raise ValidationError(f"--k must be comma-separated integers, got {args.k!r}", parameter="k") from None
    engine_config = EngineConfig(device=args.device, max_num_seqs=args.max_num_seqs)
    runner = None
    if args.ray:
        from server.batch_ray import ray_chunk_runner

        runner = ray_chunk_runner(None if args.ray == "local" else args.ray, args.ray_workers, engine_config)
    summary, _ = run_batch(args.input, args.output, default_model=args.model, ks=ks, engine_config=engine_config,
                           chunk_size=args.chunk_size, progress=not args.json, chunk_runner=runner)
    if args.quality:
        _write_batch_quality(args)
    data = asdict(summary)
    data["tokens_per_s"] = (summary.prompt_tokens + summary.completion_tokens) / max(summary.seconds, 1e-9)
    data["requests_per_s"] = summary.requests / max(summary.seconds, 1e-9)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(f"{summary.lines} lines, {summary.requests} requests answered ({summary.skipped} already done), {summary.errors} errors, "
              f"{summary.prompt_tokens} prompt + {summary.completion_tokens} generated tokens in {summary.seconds:.1f} s "
              f"({data['requests_per_s']:.1f} req/s, {data['tokens_per_s']:.0f} tok/s)", file=sys.stderr)
        if summary.duplicates:
            print(f"duplicate custom_id (not run): {', '.join(summary.duplicates)}", file=sys.stderr)
    return 0


def _write_batch_quality(args: argparse.Namespace) -> None:
    from moe_serve.evaluation import quality_path, write_quality
    from moe_serve.registry import resolve_model
    from server.batch import quality_rows

    rows = quality_rows(args.output, args.input.stem)
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        target = quality_path(resolve_model(model), args.output.parent)
        write_quality(target, mine)
        print(f"wrote {len(mine)} quality rows for {model} to {target}", file=sys.stderr)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from server.app import create_app
    from server.settings import ServerSettings

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kwargs = dict(
        models=tuple(args.models), host=args.host, port=args.port, max_tokens_cap=args.max_tokens_cap,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, kv_cache_tokens=args.kv_cache_tokens,
        max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes, expert_metrics=args.expert_metrics,
        device=args.device, drain_timeout=args.drain_timeout,
    )
    if args.api_key:
        kwargs["api_key"] = args.api_key
    settings = ServerSettings(**kwargs)
    app = create_app(settings)
    logging.getLogger("moe_serve.server").info("serving %s on http://%s:%d", ", ".join(app.state.ctx.models), args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_graceful_shutdown=int(args.drain_timeout))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    add_serve_command(commands)
    add_batch_command(commands)
    args = parser.parse_args(argv)
    if args.command in ("serve", "batch"):
        from moe_serve.errors import MoEServeError

        try:
            return serve(args) if args.command == "serve" else batch(args)
        except MoEServeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
