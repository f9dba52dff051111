"""Writes dashboards/moe-serve.json (run: python deploy/grafana/build_dashboard.py). Panels are data so
that every PromQL expression can be tested against a real Prometheus (tests/deploy).

No panel pools models: every query is filtered by the `model` template variable and every aggregation keeps
`model` (a series per model, named in its legend); latency by k is split by endpoint too, and the expert-load
heatmap is repeated, one panel per selected model."""

from __future__ import annotations

import json
from pathlib import Path

M = '{model=~"$model"}'
R = "[$__rate_interval]"


def quantiles(metric: str, by_endpoint: bool = False) -> list[tuple[str, str]]:
    """p50 / p95 / p99 by model and k (and endpoint)."""
    labels, legend = (
        ("le, model, k, endpoint", "{{model}} {{endpoint}}") if by_endpoint else ("le, model, k", "{{model}}")
    )
    return [
        (
            f"histogram_quantile({q}, sum by ({labels}) (rate({metric}_bucket{M}{R})))",
            f"{legend} p{int(q * 100)} k={{{{k}}}}",
        )
        for q in (0.5, 0.95, 0.99)
    ]


PANELS = [
    (
        "Requests per second by endpoint and status",
        "timeseries",
        "reqps",
        [
            (
                f"sum by (model, endpoint, status) (rate(moe_serve_requests_total{M}{R}))",
                "{{model}} {{endpoint}} {{status}}",
            )
        ],
    ),
    (
        "Errors per second (4xx/5xx)",
        "timeseries",
        "reqps",
        [
            (
                f"sum by (model, endpoint, status)"
                f' (rate(moe_serve_requests_total{{model=~"$model", status=~"4..|5.."}}{R}))',
                "{{model}} {{endpoint}} {{status}}",
            )
        ],
    ),
    (
        "End-to-end latency by k",
        "timeseries",
        "s",
        quantiles("moe_serve_e2e_request_latency_seconds", by_endpoint=True),
    ),
    ("Time to first token by k", "timeseries", "s", quantiles("moe_serve_time_to_first_token_seconds")),
    ("Inter-token latency by k", "timeseries", "s", quantiles("moe_serve_inter_token_latency_seconds")),
    (
        "Queue time by k (p95)",
        "timeseries",
        "s",
        [
            (
                f"histogram_quantile(0.95, sum by (le, model, k)"
                f" (rate(moe_serve_request_queue_time_seconds_bucket{M}{R})))",
                "{{model}} k={{k}}",
            )
        ],
    ),
    (
        "Tokens per second",
        "timeseries",
        "none",
        [
            (f"sum by (model, k) (rate(moe_serve_generation_tokens_total{M}{R}))", "{{model}} generated k={{k}}"),
            (f"sum by (model, k) (rate(moe_serve_prompt_tokens_total{M}{R}))", "{{model}} prompt k={{k}}"),
        ],
    ),
    (
        "Running and waiting",
        "timeseries",
        "none",
        [
            (f"sum by (model) (moe_serve_num_requests_running{M})", "running {{model}}"),
            (f"sum by (model) (moe_serve_num_requests_waiting{M})", "waiting {{model}}"),
        ],
    ),
    ("KV cache reserved", "timeseries", "percentunit", [(f"moe_serve_kv_cache_usage_ratio{M}", "{{model}}")]),
    (
        "Expert load per layer (tokens/s)",
        "heatmap",
        "none",
        [
            (
                f"sum by (model, layer, expert) (rate(moe_serve_expert_tokens_total{M}{R}))",
                "{{model}} layer {{layer}} expert {{expert}}",
            )
        ],
    ),
    (
        "Expert load balance per layer (normalised entropy, 1 = uniform)",
        "timeseries",
        "none",
        [
            (f"moe_serve_expert_load_entropy{M}", "{{model}} layer {{layer}}"),
            (f"moe_serve_expert_load_max_share{M}", "{{model}} max share layer {{layer}}"),
        ],
    ),
    (
        "Quality against k",
        "barchart",
        "none",
        [
            (
                f"max by (model, k, metric, dataset, weights) (moe_serve_quality{M})",
                "{{model}} {{weights}} {{metric}} ({{dataset}}) k={{k}}",
            )
        ],
    ),
    (
        'Experts per token: "auto" k now, and the mean k of finished requests by policy',
        "timeseries",
        "none",
        [
            (f"max by (model) (moe_serve_auto_experts_per_token{M})", "auto k now {{model}}"),
            (
                f"sum by (model, policy) (rate(moe_serve_experts_per_token_sum{M}{R}))"
                f" / sum by (model, policy) (rate(moe_serve_experts_per_token_count{M}{R}))",
                "{{model}} mean k {{policy}}",
            ),
        ],
    ),
    (
        "Median latency against k (the other side of the trade-off)",
        "barchart",
        "s",
        [
            (
                "histogram_quantile(0.5, sum by (le, model, k, endpoint)"
                f" (rate(moe_serve_e2e_request_latency_seconds_bucket{M}[5m])))",
                "{{model}} {{endpoint}} k={{k}}",
            )
        ],
    ),
]


def build() -> dict:
    panels = []
    for index, (title, kind, unit, targets) in enumerate(PANELS):
        panel = {
            "id": index + 1,
            "title": title,
            "type": kind,
            "datasource": {"type": "prometheus", "uid": "prometheus"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [
                {
                    "refId": chr(ord("A") + i),
                    "expr": expr,
                    "legendFormat": legend,
                    "datasource": {"type": "prometheus", "uid": "prometheus"},
                }
                for i, (expr, legend) in enumerate(targets)
            ],
        }
        if kind == "heatmap":  # one heatmap per selected model: experts of different models never share cells
            panel.update(repeat="model", repeatDirection="h", maxPerRow=2)
        panels.append(panel)
    return {
        "uid": "moe-serve",
        "title": "moe-serve: latency and quality against k",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "model",
                    "type": "query",
                    "label": "model",
                    "includeAll": True,
                    "multi": True,
                    "current": {"text": "All", "value": "$__all"},
                    "datasource": {"type": "prometheus", "uid": "prometheus"},
                    "query": {"query": "label_values(moe_serve_num_requests_running, model)", "refId": "model"},
                    "definition": "label_values(moe_serve_num_requests_running, model)",
                    "allValue": ".*",
                    "refresh": 2,
                }
            ]
        },
        "panels": panels,
    }


if __name__ == "__main__":
    out = Path(__file__).parent / "dashboards" / "moe-serve.json"
    out.write_text(json.dumps(build(), indent=2) + "\n")
    print(f"wrote {out}")
