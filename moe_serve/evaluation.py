"""Quality against k (`moe-serve eval`): bits per byte on held-out plays for language models, accuracy and
macro-F1 on held-out passages for classifiers; results as rows, CSV, a PNG plot and quality.json."""

from __future__ import annotations

import csv
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from moe_serve.artifact import QUALITY_FILE
from moe_serve.errors import ValidationError
from moe_serve.llm import LLM

DATASETS = ("shakespeare",)
LM_WINDOW = 512  # characters per scored window (the first token of each window has no context)
CLASSIFY_PASSAGE = 256  # characters per passage, as in the classifier recipes


def dataset_inputs(dataset: str, task: str, max_items: int | None, max_len: int) -> list[tuple[str, str | None]]:
    """(text, label) pairs of the held-out split: LM windows (label None) or labelled passages, cut to
    fit a context of max_len tokens (half of it, leaving room for multi-byte characters and BOS)."""
    if dataset not in DATASETS:
        raise ValidationError(f"unknown dataset {dataset!r}; available: {', '.join(DATASETS)}", parameter="dataset")
    from moe_serve.datasets import shakespeare

    plays = shakespeare.split(held_out=True)
    if task == "causal_lm":
        window = min(LM_WINDOW, max_len // 2)
        items: list[tuple[str, str | None]] = [(text, None) for text, _ in shakespeare.passages(plays, window)]
    else:
        items = list(shakespeare.passages(plays, min(CLASSIFY_PASSAGE, max_len // 2)))
    if max_items and len(items) > max_items:  # an even sample across every held-out play, not the first ones
        step = len(items) / max_items
        items = [items[int(i * step)] for i in range(max_items)]
    return items


def evaluate(llm: LLM, ks: list[int], dataset: str = "shakespeare", max_items: int | None = None, progress: bool = True) -> list[dict[str, Any]]:
    """One row per (k, metric): {"model", "dataset", "k", "metric", "value"}."""
    task = llm.config.task
    items = dataset_inputs(dataset, task, max_items, llm.engine.max_model_len)
    texts = [text for text, _ in items]
    rows = []
    batch = 64
    with tqdm(total=len(ks) * len(texts), desc=f"eval {llm.artifact.name}", unit="text", disable=not progress) as bar:
        for k in ks:
            llm.engine.resolve_experts_per_token(k if llm.config.moe else None)
            if task == "causal_lm":
                logprob, num_bytes = 0.0, 0
                for start in range(0, len(texts), batch):
                    for score in llm.score(texts[start : start + batch], experts_per_token=k if llm.config.moe else None):
                        logprob += score.total_logprob
                        num_bytes += score.num_bytes
                    bar.update(min(batch, len(texts) - start))
                metrics = {"bits_per_byte": -logprob / math.log(2) / num_bytes}
            else:
                predictions = []
                for start in range(0, len(texts), batch):
                    predictions += [c.label for c in llm.classify(texts[start : start + batch], experts_per_token=k if llm.config.moe else None)]
                    bar.update(min(batch, len(texts) - start))
                metrics = classification_metrics([label for _, label in items], predictions)  # type: ignore[misc]
            rows += [{"model": llm.artifact.name, "dataset": dataset, "k": k, "metric": m, "value": v} for m, v in metrics.items()]
    return rows


def classification_metrics(truth: list[str], predicted: list[str]) -> dict[str, float]:
    labels = sorted(set(truth))
    f1s = []
    for label in labels:
        tp = sum(t == label and p == label for t, p in zip(truth, predicted))
        fp = sum(t != label and p == label for t, p in zip(truth, predicted))
        fn = sum(t == label and p != label for t, p in zip(truth, predicted))
        f1s.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
    accuracy = sum(t == p for t, p in zip(truth, predicted)) / len(truth)
    return {"accuracy": accuracy, "macro_f1": sum(f1s) / len(f1s)}


def write_quality(path: Path, rows: list[dict[str, Any]]) -> None:
    """Merge rows into a quality.json: entries replace earlier ones with the same dataset, k and metric."""
    existing = json.loads(path.read_text()).get("results", []) if path.is_file() else []
    key = lambda r: (r["dataset"], r["k"], r["metric"])  # noqa: E731
    merged = {key(r): r for r in existing}
    merged.update({key(r): {k: r[k] for k in ("dataset", "k", "metric", "value")} for r in rows})
    document = {"updated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": sorted(merged.values(), key=key)}
    path.write_text(json.dumps(document, indent=2) + "\n")


def quality_path(artifact_dir: Path, output_dir: Path) -> Path:
    """quality.json inside the artifact when writable, else next to the other outputs."""
    if os.access(artifact_dir, os.W_OK):
        return artifact_dir / QUALITY_FILE
    return output_dir / f"{artifact_dir.name}.{QUALITY_FILE}"


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["model", "dataset", "k", "metric", "value"])
        writer.writeheader()
        writer.writerows(rows)


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    """Quality against k: one panel per metric, one line per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = sorted({r["metric"] for r in rows})
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for model in sorted({r["model"] for r in rows if r["metric"] == metric}):
            points = sorted((r["k"], r["value"]) for r in rows if r["metric"] == metric and r["model"] == model)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=model)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("experts per token (k)")
        ax.set_ylabel(metric.replace("_", " "))
        ax.set_title(f"{metric.replace('_', ' ')} vs k ({'lower' if metric == 'bits_per_byte' else 'higher'} is better)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(rows: list[dict[str, Any]]) -> str:
    """Models as rows, k as columns, one block per metric."""
    lines = []
    for metric in sorted({r["metric"] for r in rows}):
        subset = [r for r in rows if r["metric"] == metric]
        ks = sorted({r["k"] for r in subset})
        models = sorted({r["model"] for r in subset})
        width = max(len(m) for m in models) + 2
        lines.append(f"{metric}")
        lines.append(" " * width + "".join(f"{'k=' + str(k):>9}" for k in ks))
        for model in models:
            values = {r["k"]: r["value"] for r in subset if r["model"] == model}
            lines.append(f"{model:<{width}}" + "".join(f"{values[k]:>9.4f}" if k in values else f"{'-':>9}" for k in ks))
        lines.append("")
    return "\n".join(lines)
