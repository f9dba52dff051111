"""The quality-vs-k table (`quality.json`): the one place that reads, validates, merges and writes it.

`moe-serve eval` and `moe-serve batch --quality` produce rows; an artifact may carry the table, which the
server exports as `moe_serve_quality` gauges and the dashboard plots. Layout:

    {"updated_at": "...Z", "results": [{"model": "...", "dataset": "...", "k": 2, "metric": "bits_per_byte",
                                         "value": 2.41}, ...]}

`model` is optional inside an artifact (the table belongs to that artifact). `weights` names the weight format
a row was measured with when it is not the artifact's floats (`"int8"`: `moe-serve eval --weights`, or an
artifact written by `moe-serve quantize`), and FORMAT:ACTIVATIONS where the CPU kernels rounded its activations
too (`"int8:int8"`, `"int8:auto"`: --cpu-activations); the metric `kl_from_float` is the mean KL divergence (nats per
token) of its next-token distributions from the float weights' at the same k, `kl_from_fp32_activations` the
same from its format's with fp32 activations. A row measured under an adaptive
`moe` policy names it (`"policy": "top_p=0.8"`) and its `k` is the mean k its tokens took (a number, not an
integer): such a row is identified by its policy, not its k, and sits on the quality-vs-k plot at that k.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from moe_serve.errors import ArtifactError
from moe_serve.kernels.packed import WEIGHTS_LABELS, parse_weights_label, weights_label

QUALITY_FILE = "quality.json"
LOWER_IS_BETTER = frozenset({"bits_per_byte", "perplexity", "kl_from_float"})


@dataclass(frozen=True, slots=True)
class QualityRow:
    dataset: str
    k: int | float  # a fixed k, or under `policy` the measured mean k
    metric: str
    value: float
    model: str | None = None
    policy: str | None = None  # e.g. "top_p=0.8"; None: a fixed k
    weights: str | None = None  # the weight format measured ("int8"); None: the float weights

    @property
    def key(self) -> tuple[str, str, str, float, str]:
        """What a newer row replaces: the same weights and k, or the same policy (whose measured k may move)."""
        return (self.dataset, self.weights or "", self.policy or "", 0 if self.policy else self.k, self.metric)

    @property
    def series(self) -> str:
        """The line a row belongs to in tables and plots: the model, and its weight format when packed."""
        return f"{self.model or ''} ({self.weights})" if self.weights else self.model or ""

    def to_dict(self) -> dict[str, Any]:
        return {name: value for name, value in asdict(self).items() if value is not None}


@dataclass(frozen=True, slots=True)
class QualityTable:
    rows: tuple[QualityRow, ...] = ()
    updated_at: str | None = None

    @classmethod
    def read(cls, path: Path) -> QualityTable:
        """Parse and validate a quality.json; every problem is an ArtifactError naming the file and entry."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ArtifactError(f"{path} is not a readable JSON quality table: {exc}") from None
        return cls.parse(text, str(path))

    @classmethod
    def parse(cls, text: str, where: str) -> QualityTable:
        """A quality table from its JSON text (`where` names it in errors)."""
        try:
            document = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"{where} is not a readable JSON quality table: {exc}") from None
        if not isinstance(document, dict) or not isinstance(document.get("results"), list):
            raise ArtifactError(f"{where} must be an object with a list 'results'")
        rows = tuple(_row(entry, f"{where}: results[{i}]") for i, entry in enumerate(document["results"]))
        updated = document.get("updated_at")
        return cls(rows, updated if isinstance(updated, str) else None)

    def merged(self, rows: list[QualityRow] | tuple[QualityRow, ...]) -> QualityTable:
        """A new table in which `rows` replace earlier rows with the same key (dataset, k or policy, metric)."""
        by_key = {row.key: row for row in self.rows}
        by_key.update({row.key: row for row in rows})
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return QualityTable(tuple(sorted(by_key.values(), key=lambda r: r.key)), stamp)

    def write(self, path: Path) -> None:
        """Write atomically (aside, then renamed), so a reader never sees half a table."""
        path = Path(path)
        document = {"updated_at": self.updated_at, "results": [row.to_dict() for row in self.rows]}
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    def merge_into(self, path: Path) -> QualityTable:
        """Merge this table's rows into the file at `path` (created when missing); returns what was written."""
        path = Path(path)
        existing = QualityTable.read(path) if path.is_file() else QualityTable()
        table = existing.merged(self.rows)
        table.write(path)
        return table

    def for_model(self, model: str) -> QualityTable:
        return QualityTable(tuple(r for r in self.rows if r.model in (None, model)), self.updated_at)


def _row(entry: Any, where: str) -> QualityRow:
    if not isinstance(entry, dict):
        raise ArtifactError(f"{where} must be an object")
    for name, kind in (("dataset", str), ("metric", str)):
        if not isinstance(entry.get(name), kind) or not entry[name]:
            raise ArtifactError(f"{where}.{name} must be a non-empty string, got {entry.get(name)!r}")
    policy = entry.get("policy")
    if policy is not None and (not isinstance(policy, str) or not policy):
        raise ArtifactError(f"{where}.policy must be a non-empty string, got {policy!r}")
    k = entry.get("k")
    if policy is not None:  # a measured mean k
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not math.isfinite(k) or k < 1:
            raise ArtifactError(f"{where}.k must be a number of at least 1 (a mean k), got {k!r}")
    elif not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ArtifactError(f"{where}.k must be a positive integer, got {k!r}")
    value = entry.get("value")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ArtifactError(f"{where}.value must be a finite number, got {value!r}")
    model = entry.get("model")
    if model is not None and not isinstance(model, str):
        raise ArtifactError(f"{where}.model must be a string, got {model!r}")
    weights = entry.get("weights")
    parsed = parse_weights_label(weights) if isinstance(weights, str) else None
    if weights is not None and (parsed is None or weights_label(*parsed) != weights):  # one spelling a label
        raise ArtifactError(f"{where}.weights must be one of {WEIGHTS_LABELS}, got {weights!r}")
    return QualityRow(entry["dataset"], k, entry["metric"], float(value), model, policy, weights)
