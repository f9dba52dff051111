"""`moe-serve batch --quality`: quality against k from a labelled sweep's output, with the metrics of
`moe-serve eval` (accuracy and macro-F1 of labelled classify lines, bits per byte of score lines)."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from moe_serve.evaluation.metrics import classification_metrics
from moe_serve.quality import QualityRow


def quality_rows(output_path: Path, dataset: str) -> list[QualityRow]:
    """One row per (model, k, metric) found in a batch output file."""
    labelled: dict[tuple[str, int], tuple[list[str], list[str]]] = defaultdict(lambda: ([], []))
    scored: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for raw in output_path.read_text(encoding="utf-8").splitlines():
        line = json.loads(raw)
        response = line.get("response") or {}
        if response.get("status_code") != 200 or line.get("experts_per_token") is None:
            continue
        body = response["body"]
        key = (body["model"], line["experts_per_token"])
        if body.get("object") != "list" or not body["data"]:
            continue
        if "label" in body["data"][0] and line.get("label") is not None:
            truth, predicted = labelled[key]
            truth.append(line["label"])
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
