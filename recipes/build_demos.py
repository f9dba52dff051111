"""Train (when no checkpoint exists), export and evaluate every bundled demo model.

    python -m recipes.build_demos [--retrain] [--max-items N]

Writes moe_serve/demo_models/<name>/ (bf16 artifacts with quality.json; the LMs with recipes.play_chat's
chat template) and docs/quality_vs_k.{csv,png}.
Each recipe's command, seed, split and metrics are in its artifact's provenance (config.json).
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch

from moe_serve import LLM
from moe_serve.evaluation.plot import plot
from moe_serve.evaluation.runner import evaluate
from moe_serve.evaluation.table import format_table, write_csv
from moe_serve.exporters import genre_encoder, transformer_xl
from moe_serve.exporters.base import ExportOptions
from moe_serve.quality import QUALITY_FILE, QualityTable
from moe_serve.registry import BUNDLED_DIR
from recipes import play_chat, train

DEMOS = {
    "shakespeare-hyperrouter": ("hyperrouter-lm", partial(transformer_xl.export, "hyperrouter")),
    "shakespeare-smoe": ("smoe-lm", partial(transformer_xl.export, "smoe")),
    "shakespeare-dense": ("dense-lm", partial(transformer_xl.export, "txl-dense")),
    "genre-moesart": ("moesart-clf", partial(genre_encoder.export, "moesart")),
    "genre-smear": ("smear-clf", partial(genre_encoder.export, "smear")),
    "genre-topk": ("topk-clf", partial(genre_encoder.export, "topk")),
}
KS = [1, 2, 4, 8]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--retrain", action="store_true", help="train even when runs/RECIPE exists")
    parser.add_argument(
        "--max-items", type=int, default=400, help="windows/passages sampled evenly across the held-out plays (0: all)"
    )
    parser.add_argument("--runs", type=Path, default=Path("runs"))
    parser.add_argument("--docs", type=Path, default=Path("docs"))
    args = parser.parse_args()
    rows = []
    for name, (recipe, export) in DEMOS.items():
        checkpoint = args.runs / recipe
        if args.retrain or not (checkpoint / "checkpoint.safetensors").is_file():
            train.main([recipe, "--out", str(checkpoint)])
        artifact = export(checkpoint, BUNDLED_DIR / name, ExportOptions(dtype=torch.bfloat16, overwrite=True))
        if train.RECIPES[recipe].kind == "lm":
            play_chat.install(artifact)  # chat that works out of the box: the template fits the training text
        model_rows = evaluate(LLM(artifact), KS, "shakespeare", args.max_items or None)
        QualityTable(tuple(model_rows)).merge_into(artifact / QUALITY_FILE)
        rows += model_rows
    write_csv(args.docs / "quality_vs_k.csv", rows)
    plot(args.docs / "quality_vs_k.png", rows)
    print(format_table(rows))


if __name__ == "__main__":
    main()
