"""python -m exporters FORMAT SRC DST [--dtype float32|bfloat16|float16] [--overwrite]

Formats: hf (Hugging Face Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE directories); hyperrouter, smoe,
txl-dense (Transformer-XL recipes); moesart, smear, topk (encoder classifier recipes).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch

from moe_serve.errors import MoEServeError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def _exporters() -> dict[str, Callable[..., Path]]:
    from exporters import genre_encoder, transformer_xl
    from exporters.hf import export_hf

    formats: dict[str, Callable[..., Path]] = {"hf": export_hf}
    for fmt in transformer_xl.METHODS:
        formats[fmt] = partial(transformer_xl.export, fmt)
    for fmt in genre_encoder.FOLDED:
        formats[fmt] = partial(genre_encoder.export, fmt)
    return formats


def main(argv: Sequence[str] | None = None) -> int:
    exporters = _exporters()
    parser = argparse.ArgumentParser(prog="python -m exporters", description="Convert a checkpoint into a moe-serve artifact.")
    parser.add_argument("format", choices=sorted(exporters), help="source format")
    parser.add_argument("src", type=Path, help="source checkpoint directory")
    parser.add_argument("dst", type=Path, help="artifact directory to write (written aside, then renamed)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="storage dtype (default: as in the source)")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        path = exporters[args.format](args.src, args.dst, dtype=DTYPES.get(args.dtype), progress=not args.quiet, overwrite=args.overwrite)
    except MoEServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
