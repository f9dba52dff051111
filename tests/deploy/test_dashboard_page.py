"""GET /dashboard in headless Chromium (Debian's, driven by Playwright): the page loads with no external
resource, its five charts (the k of "auto" requests over time among them) render with data after traffic,
and a screenshot is saved."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from moe_serve.config import EngineConfig
from moe_serve.quality import QualityRow, QualityTable
from moe_serve.server.settings import ServerSettings
from tests.deploy.system import require_binary
from tests.server.conftest import start_server

pytestmark = pytest.mark.slow
SCREENSHOT_DIR = Path(
    os.environ.get("MOE_SERVE_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts")
)
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def test_dashboard_renders_charts_with_data(artifacts) -> None:
    chromium = require_binary("chromium", "chromium")
    playwright = pytest.importorskip("playwright.sync_api")
    QualityTable(tuple(QualityRow("shakespeare", k, "bits_per_byte", 3.0 - 0.1 * k) for k in (1, 2, 4))).merge_into(
        artifacts["lm"] / "quality.json"
    )
    server = start_server(ServerSettings(models=(str(artifacts["lm"]),), engine=EngineConfig(target_itl_ms=1000)))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            page_html = http.get("/dashboard").text
            assert "<script src" not in page_html and "http://" not in page_html and "https://" not in page_html
            for k in (1, 2, 4):
                for _ in range(3):
                    assert (
                        http.post(
                            "/v1/completions", json={"prompt": "Enter GHOST.", "max_tokens": 8, "experts_per_token": k}
                        ).status_code
                        == 200
                    )
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
            page = browser.new_page(viewport={"width": 1280, "height": 720})
            external = []
            page.on(
                "request",
                lambda request: external.append(request.url) if not request.url.startswith(server.url) else None,
            )
            page.goto(server.url + "/dashboard")
            # Throughput needs two polls that see tokens: keep generating while the page polls.
            with httpx.Client(base_url=server.url, timeout=60) as http:
                for _ in range(6):
                    http.post("/v1/completions", json={"prompt": "Exeunt.", "max_tokens": 8, "experts_per_token": 2})
                    page.wait_for_timeout(300)
            for chart in ("latency", "throughput", "experts", "quality", "autok"):
                page.wait_for_selector(f"#{chart}-card[data-rendered='true']", timeout=15000)
            assert "tiny-lm" in page.inner_text("#status")
            SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT_DIR / "dashboard.png"), full_page=True)
            browser.close()
        assert external == []
        assert (SCREENSHOT_DIR / "dashboard.png").stat().st_size > 10_000
    finally:
        server.stop()
