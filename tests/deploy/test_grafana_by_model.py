"""The Grafana dashboard never pools models: every query is filtered by the `model`
template variable and every aggregation keeps `model`, so the expert-load heatmap does not add different
models' experts into the same cells; latency by k is split by endpoint too. (Whether every query returns data
from a real Prometheus is test_prometheus.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards" / "moe-serve.json"


def panels() -> list[dict]:
    return json.loads(DASHBOARD.read_text())["panels"]


def test_every_query_is_filtered_by_the_model_variable() -> None:
    variables = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    assert "model" in variables
    for panel in panels():
        for target in panel["targets"]:
            assert '"$model"' in target["expr"], (panel["title"], target["expr"])


def test_no_aggregation_pools_models() -> None:
    for panel in panels():
        for target in panel["targets"]:
            clauses = re.findall(r"\b(?:sum|max|min|avg|count) by \(([^)]*)\)", target["expr"])
            for clause in clauses:
                assert "model" in {label.strip() for label in clause.split(",")}, (panel["title"], target["expr"])
            if clauses:
                assert "{{model}}" in target["legendFormat"], (panel["title"], target["legendFormat"])


def test_latency_by_k_is_split_by_endpoint() -> None:
    for panel in panels():
        for target in panel["targets"]:
            if "e2e_request_latency" in target["expr"]:
                assert re.search(r"by \([^)]*\bendpoint\b", target["expr"]), (panel["title"], target["expr"])
                assert "{{endpoint}}" in target["legendFormat"]


def test_the_expert_heatmap_is_one_panel_per_model() -> None:
    (heatmap,) = [p for p in panels() if p["type"] == "heatmap"]
    assert heatmap.get("repeat") == "model"
    (target,) = heatmap["targets"]
    assert re.search(r"sum by \([^)]*\bmodel\b[^)]*\) \(rate\(moe_serve_expert_tokens_total", target["expr"])
