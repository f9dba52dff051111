"""The `moe-serve` console script: the runtime's commands (moe_serve.cli) plus `serve`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

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
    add_serve_command(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)))
    args = parser.parse_args(argv)
    if args.command == "serve":
        from moe_serve.errors import MoEServeError

        try:
            return serve(args)
        except MoEServeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
