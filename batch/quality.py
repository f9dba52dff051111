"""`moe-serve batch --quality`: quality against k from a labelled sweep's output, with the metrics of
`moe-serve eval` (accuracy and macro-F1 of labelled classify lines, bits per byte of score lines).

The k of a result is the one its body reports (`usage.experts_per_token`); a classify line's true class is
its input line's top-level "label", found through the output's custom_id (`labels`)."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from moe_serve.batch.jsonl import ParsedInput
from moe_serve.evaluation.metrics import classification_metrics
from moe_serve.quality import QualityRow


def labels_of(parsed: ParsedInput) -> dict[str, str]:
    """Output custom_id -> the true class of its input line (labelled lines only)."""
    return {item.output_custom_id: item.label for item in parsed.items if item.label is not None}


def quality_rows(output_path: Path, dataset: str, labels: dict[str, str]) -> list[QualityRow]:
    """One row per (model, k, metric) found in a batch output file."""
    labelled: dict[tuple[str, int], tuple[list[str], list[str]]] = defaultdict(lambda: ([], []))
    scored: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for raw in output_path.read_text(encoding="utf-8").splitlines():
        line = json.loads(raw)
        response = line.get("response") or {}
        body = response.get("body") or {}
        k = (body.get("usage") or {}).get("experts_per_token")
        if response.get("status_code") != 200 or k is None or body.get("object") != "list" or not body["data"]:
            continue
        key = (body["model"], k)
        if "label" in body["data"][0] and line["custom_id"] in labels:
            truth, predicted = labelled[key]
            truth.append(labels[line["custom_id"]])
            predicted.append(body["data"][0]["label"])
        elif "bits_per_byte" in body["data"][0]:
            for item in body["data"]:
                scored[key][0] += -item["total_logprob"] / math.log(2)
                scored[key][1] += item["num_bytes"]
    rows = [
        QualityRow(dataset, k, metric, value, model)
        for (model, k), (truth, predicted) in labelled.items()
        for metric, value in classification_metrics(truth, predicted).items()
    ]
    rows += [
        QualityRow(dataset, k, "bits_per_byte", bits / nbytes, model)
        for (model, k), (bits, nbytes) in scored.items()
        if nbytes
    ]
    return sorted(rows, key=lambda r: (r.model or "", r.metric, r.k))
