"""`moe-serve batch --quality`: quality against k from a labelled sweep's output, with the metrics of
`moe-serve eval` (accuracy and macro-F1 of labelled classify lines, bits per byte of score lines).

The k of a result is the one its body reports (`usage.experts_per_token`); under a `moe` policy the row is
the policy's (named as `moe-serve eval` names it, with its resolved min and max) at the mean of its lines'
`usage.experts_per_token_mean`. A classify line's true class is its input line's top-level "label", found
through the output's custom_id (`labels`)."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from moe_serve.batch.jsonl import ParsedInput
from moe_serve.evaluation.metrics import classification_metrics
from moe_serve.moe_policy import MoEPolicy
from moe_serve.quality import QualityRow

Key = tuple[str, int | str]  # (model, a fixed k or a policy's name)


def labels_of(parsed: ParsedInput) -> dict[str, str]:
    """Output custom_id -> the true class of its input line (labelled lines only)."""
    return {item.output_custom_id: item.label for item in parsed.items if item.label is not None}


def _key(body: dict, mean_ks: dict[Key, list[float]]) -> Key | None:
    """The row a result belongs to (None: no k to file it under); a policy's mean k is noted in mean_ks."""
    usage = body.get("usage") or {}
    if usage.get("experts_per_token") is not None:
        return body["model"], usage["experts_per_token"]
    details = usage.get("experts_per_token_details")
    if details is None or usage.get("experts_per_token_mean") is None:
        return None
    key = (body["model"], MoEPolicy(details["policy"], details["p"], details["min"], details["max"]).name)
    mean_ks.setdefault(key, []).append(usage["experts_per_token_mean"])
    return key


def quality_rows(output_path: Path, dataset: str, labels: dict[str, str]) -> list[QualityRow]:
    """One row per (model, k or policy, metric) found in a batch output file."""
    labelled: dict[Key, tuple[list[str], list[str]]] = defaultdict(lambda: ([], []))
    scored: dict[Key, list[float]] = defaultdict(lambda: [0.0, 0.0])
    mean_ks: dict[Key, list[float]] = {}
    for raw in output_path.read_text(encoding="utf-8").splitlines():
        line = json.loads(raw)
        response = line.get("response") or {}
        body = response.get("body") or {}
        if response.get("status_code") != 200 or body.get("object") != "list" or not body["data"]:
            continue
        key = _key(body, mean_ks)
        if key is None:
            continue
        if "label" in body["data"][0] and line["custom_id"] in labels:
            truth, predicted = labelled[key]
            truth.append(labels[line["custom_id"]])
            predicted.append(body["data"][0]["label"])
        elif "bits_per_byte" in body["data"][0]:
            for item in body["data"]:
                scored[key][0] += -item["total_logprob"] / math.log(2)
                scored[key][1] += item["num_bytes"]

    def row(key: Key, metric: str, value: float) -> QualityRow:
        model, k = key
        if isinstance(k, int):
            return QualityRow(dataset, k, metric, value, model)
        return QualityRow(dataset, sum(mean_ks[key]) / len(mean_ks[key]), metric, value, model, policy=k)

    rows = [
        row(key, metric, value)
        for key, (truth, predicted) in labelled.items()
        for metric, value in classification_metrics(truth, predicted).items()
    ]
    rows += [row(key, "bits_per_byte", bits / nbytes) for key, (bits, nbytes) in scored.items() if nbytes]
    return sorted(rows, key=lambda r: (r.model or "", r.metric, r.policy or "", r.k))
