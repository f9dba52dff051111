"""Quality rows as a CSV file and as a text table (models as rows, k as columns, a block per metric; runs
under an adaptive policy listed below each block with the mean k they took)."""

from __future__ import annotations

import csv
from pathlib import Path

from moe_serve.quality import QualityRow

CSV_FIELDS = ["model", "dataset", "k", "metric", "value", "policy"]


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
        models = sorted({r.model or "" for r in subset})
        width = max(len(m) for m in models) + 2
        lines.append(f"{metric}")
        lines.append(" " * width + "".join(f"{'k=' + str(k):>9}" for k in ks))
        for model in models:
            values = {r.k: r.value for r in subset if (r.model or "") == model}
            lines.append(
                f"{model:<{width}}" + "".join(f"{values[k]:>9.4f}" if k in values else f"{'-':>9}" for k in ks)
            )
        lines += [*_adaptive_lines(adaptive), ""]
    return "\n".join(lines)


def _adaptive_lines(rows: list[QualityRow]) -> list[str]:
    """Adaptive-policy runs, one line each: the policy, the mean k it took, the value."""
    return [f"{r.model or ''}  {r.policy}  mean k={r.k:.3f}  {r.value:.4f}" for r in rows]
