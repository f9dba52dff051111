"""GET /dashboard: a self-contained page (no CDN, no external script) with live latency by k, throughput,
expert load, the served models' quality-vs-k curves and the k of "auto" requests over time; GET
/dashboard/data is what it polls."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

router = APIRouter()
PAGE = Path(__file__).parent / "dashboard.html"


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard() -> HTMLResponse:
    return HTMLResponse(PAGE.read_text(encoding="utf-8"))


@router.get("/dashboard/data")
async def dashboard_data(request: Request) -> dict:
    ctx = request.app.state.ctx
    metrics = ctx.metrics
    return {
        "latency_by_k": _quantiles_by_k(metrics.e2e.collect()),
        "ttft_by_k": _quantiles_by_k(metrics.ttft.collect()),
        "generated_tokens": _total(metrics.generation_tokens.collect(), "moe_serve_generation_tokens_total"),
        "running": {name: m.engine.num_running for name, m in ctx.models.items()},
        "waiting": {name: m.engine.num_waiting for name, m in ctx.models.items()},
        # The k experts_per_token "auto" runs with now, per model with a latency target: the page plots it
        # over time.
        "auto_k": {name: m.engine.auto_k for name, m in ctx.models.items() if m.engine.auto_k is not None},
        "expert_load": {
            name: {str(layer): counts for layer, counts in m.engine.expert_load.totals().items()}
            for name, m in ctx.models.items()
            if m.engine.expert_load is not None
        },
        "quality": [
            {"model": name, "dataset": row.dataset, "metric": row.metric, "k": row.k, "value": row.value}
            for name, m in ctx.models.items()
            for row in (m.artifact.quality.rows if m.artifact.quality else ())
            if row.policy is None  # the chart draws quality at fixed k; adaptive runs are in quality.json
        ],
    }


def _quantiles_by_k(families) -> dict[str, dict[str, float]]:
    """p50 / p95 per k from cumulative histogram buckets (all models and endpoints together)."""
    buckets: dict[str, dict[float, float]] = {}
    for family in families:
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                per_k = buckets.setdefault(sample.labels["k"], {})
                bound = float(sample.labels["le"])
                per_k[bound] = per_k.get(bound, 0.0) + sample.value
    out = {}
    for k, cumulative in buckets.items():
        bounds = sorted(cumulative)
        total = cumulative[bounds[-1]]
        if not total:
            continue
        out[k] = {name: _quantile(bounds, cumulative, total * q) for name, q in (("p50", 0.5), ("p95", 0.95))}
        out[k]["count"] = total
    return dict(sorted(out.items(), key=lambda item: int(item[0]) if item[0].isdigit() else 0))


def _quantile(bounds: list[float], cumulative: dict[float, float], rank: float) -> float:
    previous_bound, previous_count = 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if bound == float("inf"):
                return previous_bound
            span = count - previous_count
            return previous_bound + (bound - previous_bound) * ((rank - previous_count) / span if span else 1.0)
        previous_bound, previous_count = bound, count
    return previous_bound


def _total(families, name: str) -> float:
    return sum(s.value for f in families for s in f.samples if s.name == name)
