"""Quality metrics shared by `moe-serve eval` and `moe-serve batch --quality`."""

from __future__ import annotations

import math


def classification_metrics(truth: list[str], predicted: list[str]) -> dict[str, float]:
    """Accuracy and macro-F1 (over the labels present in `truth`)."""
    labels = sorted(set(truth))
    f1s = []
    for label in labels:
        tp = sum(t == label and p == label for t, p in zip(truth, predicted, strict=True))
        fp = sum(t != label and p == label for t, p in zip(truth, predicted, strict=True))
        fn = sum(t == label and p != label for t, p in zip(truth, predicted, strict=True))
        f1s.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
    accuracy = sum(t == p for t, p in zip(truth, predicted, strict=True)) / len(truth)
    return {"accuracy": accuracy, "macro_f1": sum(f1s) / len(f1s)}


def bits_per_byte(total_logprob: float, num_bytes: int) -> float:
    """-log2 p(text) / bytes, from a natural-log total."""
    return -total_logprob / math.log(2) / num_bytes
