"""GET /dashboard: a self-contained page with live latency by k (per model and endpoint, over a recent window),
generated tokens per second against time, expert load, the served models' quality-vs-k curves and the k of
"auto" requests over time; GET /dashboard/data is what it polls.

The charts are drawn by Chart.js and its matrix (heatmap) plugin, vendored here (chart.umd.min.js,
chartjs-chart-matrix.min.js, MIT, licenses beside them) and inlined into the page when it is served: the
page works offline, fetches nothing but /dashboard/data, and needs no path beyond the monitoring ones."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse

from moe_serve.server.metrics import RECENT_SECONDS

router = APIRouter()
HERE = Path(__file__).parent
PAGE = HERE / "dashboard.html"
VENDORED = ("chart.umd.min.js", "chartjs-chart-matrix.min.js")  # in this order: the plugin needs Chart
WINDOW_SECONDS = 60.0  # latency quantiles are of the requests that finished in the last minute


@cache
def page() -> str:
    scripts = "\n".join(f"<script>\n{(HERE / name).read_text(encoding='utf-8')}\n</script>" for name in VENDORED)
    return PAGE.read_text(encoding="utf-8").replace("<!-- vendored scripts -->", scripts, 1)


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard() -> HTMLResponse:
    return HTMLResponse(page())


@router.get("/dashboard/data")
async def dashboard_data(
    request: Request, window: float = Query(WINDOW_SECONDS, ge=1, le=RECENT_SECONDS, description="seconds")
) -> dict:
    ctx = request.app.state.ctx
    metrics = ctx.metrics
    recent = metrics.recent
    return {
        "models": sorted(ctx.models),  # the page gives each model one colour, in this order, in every chart
        "window_seconds": window,
        # p50 / p95 / count by model, endpoint and k, of the last `window` seconds (not since start)
        "latency": recent.latency(window),
        "ttft": recent.ttft(window),
        # generated tokens per second, per model, for each second of the last RECENT_SECONDS
        "throughput": recent.throughput(RECENT_SECONDS),
        "generated_tokens": _by_model(metrics.generation_tokens.collect(), "moe_serve_generation_tokens_total"),
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
            {
                "model": name if row.weights is None else f"{name} ({row.weights})",  # a line per weight format
                "dataset": row.dataset,
                "metric": row.metric,
                "k": row.k,
                "value": row.value,
            }
            for name, m in ctx.models.items()
            for row in (m.artifact.quality.rows if m.artifact.quality else ())
            if row.policy is None  # the chart draws quality at fixed k; adaptive runs are in quality.json
        ],
    }


def _by_model(families, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            if sample.name == name:
                out[sample.labels["model"]] = out.get(sample.labels["model"], 0.0) + sample.value
    return out
