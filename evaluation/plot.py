"""Quality against k as a PNG: one panel per metric, one line per model and weight format, adaptive-policy runs
as labelled points at their measured mean k (matplotlib, the `eval` extra)."""

from __future__ import annotations

from pathlib import Path

from moe_serve.quality import LOWER_IS_BETTER, QualityRow


def plot(path: Path, rows: list[QualityRow]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = sorted({r.metric for r in rows})
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for model in sorted({r.series for r in rows if r.metric == metric}):
            mine = [r for r in rows if r.metric == metric and r.series == model]
            points = sorted((r.k, r.value) for r in mine if r.policy is None)
            (line,) = ax.plot([k for k, _ in points], [v for _, v in points], marker="o", label=model)
            adaptive = sorted((r.k, r.value, r.policy) for r in mine if r.policy is not None)
            if adaptive:  # each policy at the mean k it took, in the model's colour
                ax.scatter([k for k, _, _ in adaptive], [v for _, v, _ in adaptive], marker="D", color=line.get_color(),
                           label=f"{model} (adaptive, at mean k)")  # fmt: skip
                for k, v, policy in adaptive:
                    ax.annotate(policy, (k, v), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("experts per token (k)")
        ax.set_ylabel(metric.replace("_", " "))
        better = "lower" if metric in LOWER_IS_BETTER else "higher"
        ax.set_title(f"{metric.replace('_', ' ')} vs k ({better} is better)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
