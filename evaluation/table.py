"""Quality rows as a CSV file and as a text table (models, and each weight format measured, as rows, k as
columns, a block per metric; runs under an adaptive policy listed below each block with the mean k they took)."""

from __future__ import annotations

import csv
from pathlib import Path

from moe_serve.quality import QualityRow

CSV_FIELDS = ["model", "weights", "dataset", "k", "metric", "value", "policy"]


def write_csv(path: Path, rows: list[QualityRow]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows({name: getattr(row, name) for name in CSV_FIELDS} for row in rows)


def format_table(rows: list[QualityRow]) -> str:
    lines = []
    for metric in sorted({r.metric for r in rows}):
        subset = [r for r in rows if r.metric == metric and r.policy is None]
        adaptive = [r for r in rows if r.metric == metric and r.policy is not None]
        if not subset:
            lines += [f"{metric}", *_adaptive_lines(adaptive), ""]
            continue
        ks = sorted({r.k for r in subset})
        models = sorted({r.series for r in subset})
        width = max(len(m) for m in models) + 2
        lines.append(f"{metric}")
        lines.append(" " * width + "".join(f"{'k=' + str(k):>9}" for k in ks))
        for model in models:
            values = {r.k: r.value for r in subset if r.series == model}
            lines.append(
                f"{model:<{width}}" + "".join(f"{values[k]:>9.4f}" if k in values else f"{'-':>9}" for k in ks)
            )
        lines += [*_adaptive_lines(adaptive), ""]
    return "\n".join(lines)


def _adaptive_lines(rows: list[QualityRow]) -> list[str]:
    """Adaptive-policy runs, one line each: the policy, the mean k it took, the value."""
    return [f"{r.series}  {r.policy}  mean k={r.k:.3f}  {r.value:.4f}" for r in rows]


def format_seed_table(summaries: dict[str, dict]) -> str:
    """Recipes side by side: for each metric, a model per row and k per column, each cell the mean and
    sample standard deviation over the recipe's training seeds (an artifact's provenance `seeds`, written
    by recipes.build_demos); `n` seeds, and which one the artifact is."""
    lines = []
    cells = [(model, q) for model, summary in summaries.items() for q in summary["quality"]]
    for metric in sorted({q["metric"] for _, q in cells}):
        subset = [(model, q) for model, q in cells if q["metric"] == metric]
        ks = sorted({q["k"] for _, q in subset})
        models = list(dict.fromkeys(model for model, _ in subset))
        width = max(len(m) for m in models) + 2
        lines.append(f"{metric} (mean ± std over seeds)")
        lines.append(" " * width + "".join(f"{'k=' + str(k):>17}" for k in ks) + "   seeds (bundled)")
        for model in models:
            by_k = {q["k"]: q for m, q in subset if m == model}
            row = "".join(f"{_mean_std(by_k[k]):>17}" if k in by_k else f"{'-':>17}" for k in ks)
            summary = summaries[model]
            lines.append(f"{model:<{width}}{row}   {len(summary['seeds'])} ({summary['bundled_seed']})")
        lines.append("")
    return "\n".join(lines)


def _mean_std(cell: dict) -> str:
    std = cell.get("std")
    return f"{cell['mean']:.4f} ± {std:.4f}" if std is not None else f"{cell['mean']:.4f}"
