"""Quality rows as a CSV file and as a text table (models, and each weight format measured, as rows, k as
columns, a block per metric; runs under an adaptive policy listed below each block with the mean k they took),
and the figures over training seeds that recipes.build_demos stores in a demo's provenance."""

from __future__ import annotations

import csv
from pathlib import Path

from moe_serve.quality import QualityRow

CSV_FIELDS = ["model", "weights", "dataset", "k", "metric", "value", "policy"]
UNTRAINED_MARK = "*"  # a seeds-table cell at a k the recipe never trained at


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


def stored_summaries(name: str, provenance: dict) -> dict[str, dict]:
    """An artifact's figures over training seeds: its own (`seeds`, under `name`) and those of the
    controls it carries (`controls`: recipes whose weights are not bundled, under "NAME (control)")."""
    found = {name: provenance["seeds"]} if provenance.get("seeds") else {}
    return found | {f"{control} (control)": s for control, s in (provenance.get("controls") or {}).items()}


def format_seed_table(summaries: dict[str, dict]) -> str:
    """Recipes side by side: for each metric, a model per row and k per column, each cell the mean and
    sample standard deviation over the recipe's training seeds (an artifact's provenance `seeds`, written
    by recipes.build_demos); `n` seeds, and which one the artifact is. A cell at a k the recipe never
    trained at (its summary's `trained_k`) is marked `*`. Then, where recorded, the router diagnostics'
    deltas per k and each recipe's training precision and wall time per seed."""
    lines = []
    cells = [(model, q) for model, summary in summaries.items() for q in summary["quality"]]
    for metric in sorted({q["metric"] for _, q in cells}):
        subset = [(model, q) for model, q in cells if q["metric"] == metric]
        lines += _block(f"{metric} (mean ± std over seeds)", subset, summaries)
    diagnostics = [(model, d) for model, summary in summaries.items() for d in summary.get("diagnostics", [])]
    for name in sorted({d["name"] for _, d in diagnostics}):
        subset = [(model, d) for model, d in diagnostics if d["name"] == name]
        lines += _block(f"{name} (mean ± std over seeds; {DIAGNOSTICS.get(name, '')})", subset, summaries)
    timed = {model: s for model, s in summaries.items() if "train_seconds" in s}
    if timed:
        width = max(len(m) for m in timed) + 2
        lines.append("training (wall time per seed, mean ± std)")
        for model, summary in timed.items():
            spread, runs = summary["train_seconds"], summary.get("runs") or {}
            minutes = {"mean": spread["mean"] / 60, "std": None if spread["std"] is None else spread["std"] / 60}
            lines.append(
                f"{model:<{width}}{_mean_std(minutes, 1)} min, {summary.get('precision', '?')}"
                f"{_cpu(runs)}, {len(spread['values'])} seeds{_load(runs)}"
            )
        lines.append("")
    if any(summary.get("trained_k") for summary in summaries.values()):
        lines += [f"{UNTRAINED_MARK}: a k that recipe never trained at (its training k: trained_k in the summary)", ""]
    return "\n".join(lines)


def _load(runs: dict[str, dict]) -> str:
    """The range of the seeds' 15-minute load averages as each ended (other processes stretch a run's wall
    time), where recorded."""
    loads = [facts["load_average"][2] for facts in runs.values() if facts.get("load_average")]
    if not loads:
        return ""
    return f", 15-min load average at the end {min(loads):.1f}-{max(loads):.1f} ({len(loads)} of {len(runs)} seeds)"


def _cpu(runs: dict[str, dict]) -> str:
    """Whether the seeds' CPUs had bf16 matrix units (what their wall time depends on), if they agree."""
    units = {facts.get("cpu_bf16_units") for facts in runs.values()} - {None}
    if len(units) != 1:
        return ""
    return ", CPU with bf16 units" if units.pop() else ", CPU without bf16 units"


# What each diagnostic in a seeds summary measures (recipes.diagnostics), printed with its table.
DIAGNOSTICS = {
    "plain_routing_delta_bits_per_byte": "bits per byte with the graph mixing off, minus with it",
    "swap_to_init_delta_bits_per_byte": "bits per byte with the routers at their initial values, minus trained",
    "fixed_hyper_expert_delta_bits_per_byte": "bits per byte with one HyperExpert for every token, minus trained",
}


def _block(title: str, subset: list[tuple[str, dict]], summaries: dict[str, dict]) -> list[str]:
    """One table: a model per row, k per column, each cell the mean ± std of one of its dicts."""
    ks = sorted({cell["k"] for _, cell in subset})
    models = list(dict.fromkeys(model for model, _ in subset))
    width = max(len(m) for m in models) + 2
    lines = [title, " " * width + "".join(f"{'k=' + str(k):>17} " for k in ks) + "   seeds (bundled)"]
    for model in models:
        by_k = {cell["k"]: cell for m, cell in subset if m == model}
        summary = summaries[model]
        trained = summary.get("trained_k")
        row = "".join(
            f"{_mean_std(by_k[k]) + (UNTRAINED_MARK if trained and k not in trained else ' '):>18}"
            if k in by_k
            else f"{'- ':>18}"
            for k in ks
        )
        lines.append(f"{model:<{width}}{row}   {len(summary['seeds'])} ({summary['bundled_seed']})")
    return [*lines, ""]


def _mean_std(cell: dict, digits: int = 4) -> str:
    std = cell.get("std")
    return f"{cell['mean']:.{digits}f} ± {std:.{digits}f}" if std is not None else f"{cell['mean']:.{digits}f}"
