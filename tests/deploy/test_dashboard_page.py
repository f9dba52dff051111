"""GET /dashboard in headless Chromium (Debian's, driven by Playwright), from a real server whose two models
have served requests: the page loads nothing from outside the server, its charts (Chart.js, vendored) render
with data, every axis has a title and ticks (the k axis a tick under each k, y axes more than their ends),
legends sit outside the plot areas, a model has one colour in every chart, no JavaScript error occurs, and a
screenshot is saved (MOE_SERVE_UPDATE_DOCS=1 also writes it to docs/dashboard.png)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

from moe_serve.config import EngineConfig
from moe_serve.quality import QualityRow, QualityTable
from moe_serve.server.settings import ServerSettings
from tests.deploy.system import require_binary
from tests.server.conftest import start_server

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT_DIR = Path(os.environ.get("MOE_SERVE_TEST_ARTIFACTS", ROOT / "test-artifacts"))
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
CARDS = ("latency", "throughput", "experts", "quality", "autok")

# Every chart on the page, as the test checks it: axes (title, tick labels), legend and plot boxes, the
# colour and label of each dataset.
CHARTS = """() => [...document.querySelectorAll("canvas")].map(canvas => {
  const chart = Chart.getChart(canvas);
  if (!chart) return { id: canvas.id, missing: true };
  const scales = Object.fromEntries(Object.entries(chart.scales).map(([id, s]) => [id, {
    title: s.options.title && s.options.title.display ? s.options.title.text : "",
    ticks: s.ticks.map((t, i) => String(s.getLabelForValue ? (s.type === "category" ? s.getLabelForValue(t.value) :
      (Array.isArray(t.label) ? t.label.join(" ") : t.label)) : t.label)),
  }]));
  const legend = chart.legend && chart.legend.options.display && chart.legend.legendItems.length
    ? { top: chart.legend.top, bottom: chart.legend.bottom } : null;
  return {
    id: canvas.id, type: chart.config.type, scales, legend, title: chart.options.plugins.title.text || "",
    area: { top: chart.chartArea.top, bottom: chart.chartArea.bottom },
    datasets: chart.data.datasets.map(d => ({ label: d.label, colour: d.borderColor, points: d.data.length })),
  };
})"""


def test_dashboard_renders_charts_with_data(artifacts) -> None:
    chromium = require_binary("chromium", "chromium")
    playwright = pytest.importorskip("playwright.sync_api")
    QualityTable(
        tuple(
            QualityRow("shakespeare", k, metric, v)
            for k in (1, 2, 4)
            for metric, v in (("bits_per_byte", 3.0 - 0.1 * k), ("accuracy", 0.2 + 0.05 * k))
        )
    ).merge_into(artifacts["lm"] / "quality.json")
    models = (str(artifacts["lm"]), str(artifacts["clf"]))
    server = start_server(ServerSettings(models=models, engine=EngineConfig(target_itl_ms=1000)))

    def traffic(http: httpx.Client, rounds: int) -> None:
        for _ in range(rounds):
            for k in (1, 2, 4):
                body = {"model": "tiny-lm", "prompt": "Enter GHOST.", "max_tokens": 24, "experts_per_token": k}
                assert http.post("/v1/completions", json=body).status_code == 200
                body = {"model": "tiny-clf", "input": "Exit, pursued by a bear.", "experts_per_token": k}
                assert http.post("/v1/classify", json=body).status_code == 200
            chat = {"model": "tiny-lm", "messages": [{"role": "user", "content": "Speak."}], "max_tokens": 16}
            assert http.post("/v1/chat/completions", json=chat).status_code == 200
            auto = {"model": "tiny-lm", "prompt": "Act II.", "max_tokens": 8, "experts_per_token": "auto"}
            assert http.post("/v1/completions", json=auto).status_code == 200

    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            page_html = http.get("/dashboard").text
            assert not re.search(r"<script[^>]+src=", page_html)  # the vendored library is inlined
            assert not re.search(r"""(src|href)=["']?(https?:)?//""", page_html)
            traffic(http, 2)
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            external, errors = [], []
            page.on("request", lambda r: external.append(r.url) if not r.url.startswith(server.url) else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
            page.goto(server.url + "/dashboard")
            with httpx.Client(base_url=server.url, timeout=60) as http:  # traffic while the page polls
                for _ in range(4):
                    traffic(http, 1)
                    page.wait_for_timeout(300)
            for card in CARDS:
                page.wait_for_selector(f"#{card}-card[data-rendered='true']", timeout=15000)
            page.wait_for_timeout(1500)  # a poll after the last requests
            assert "tiny-lm" in page.inner_text("#status")
            charts = page.evaluate(CHARTS)
            SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT_DIR / "dashboard.png"), full_page=True)
            browser.close()
        assert external == []
        assert errors == []
        check_charts(charts)
        assert (SCREENSHOT_DIR / "dashboard.png").stat().st_size > 10_000
        if os.environ.get("MOE_SERVE_UPDATE_DOCS") == "1":
            shutil.copyfile(SCREENSHOT_DIR / "dashboard.png", ROOT / "docs" / "dashboard.png")
    finally:
        server.stop()


def check_charts(charts: list[dict]) -> None:
    assert charts and not [c for c in charts if c.get("missing")]
    by_id = {c["id"]: c for c in charts}
    # latency: one chart per endpoint, a tick under each k, y with more than its two ends
    latency = {c["title"]: c["scales"]["x"]["ticks"] for c in charts if c["id"].startswith("latency-")}
    assert latency["/completions"] == ["1", "2", "4", "auto"]  # a tick under each k requested
    assert latency["/classify"] == ["1", "2", "4"] and latency["/chat/completions"] == ["2"]
    quality = [c for c in charts if c["id"].startswith("quality-")]
    assert len(quality) == 2  # accuracy, bits per byte: one chart per metric
    for chart in quality:
        assert chart["scales"]["x"]["ticks"] == ["1", "2", "4"]
    heatmaps = [c for c in charts if c["id"].startswith("experts-")]
    assert len(heatmaps) == 2  # one per model
    for chart in heatmaps:
        assert chart["type"] == "matrix"
        assert chart["scales"]["x"]["title"] == "expert" and len(chart["scales"]["x"]["ticks"]) >= 2
        assert chart["scales"]["y"]["title"] == "layer"
    assert by_id["throughput"]["scales"]["x"]["title"] == "time"
    assert all(re.fullmatch(r"\d\d:\d\d:\d\d", t) for t in by_id["throughput"]["scales"]["x"]["ticks"])
    for chart in charts:
        for axis, scale in chart["scales"].items():
            assert scale["title"], (chart["id"], axis)
            # y axes: more than their two ends (a heatmap's layers: the tiny models have one MoE layer); x axes:
            # a tick under each category, checked above
            minimum = 3 if axis == "y" and chart["type"] != "matrix" else 1
            assert len(scale["ticks"]) >= minimum, (chart["id"], axis, scale["ticks"])
        if chart["legend"]:  # legends below the plot, never over it
            assert chart["legend"]["top"] >= chart["area"]["bottom"], chart["id"]
    # one colour per model across every chart
    colours: dict[str, set[str]] = {}
    for chart in charts:
        if chart["type"] == "matrix":
            continue
        for dataset in chart["datasets"]:
            model = dataset["label"].split(" ")[0].rstrip(":")
            colours.setdefault(model, set()).add(dataset["colour"])
    assert set(colours) >= {"tiny-lm", "tiny-clf"}
    assert all(len(c) == 1 for c in colours.values()), colours
    assert colours["tiny-lm"] != colours["tiny-clf"]
