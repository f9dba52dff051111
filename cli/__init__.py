"""The `moe-serve` command line: one parser (moe_serve.cli.parser), one function per command
(moe_serve.cli.commands), one error path. `moe-serve`, `python -m moe_serve` and `python -m moe_serve.cli`
are the same program."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from moe_serve.errors import MoEServeError


def main(argv: Sequence[str] | None = None) -> int:
    from moe_serve.cli.commands import COMMANDS
    from moe_serve.cli.parser import build_parser

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command](args)
    except MoEServeError as exc:  # errors the user can fix: one line, status 2, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
