"""deploy/ against the real thing: promtool checks prometheus.yml, a real Prometheus scrapes a running
moe-serve, and every PromQL expression of the Grafana dashboard returns data after traffic at two k (and
"auto")."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from moe_serve.config import EngineConfig
from moe_serve.quality import QualityRow, QualityTable
from moe_serve.server.settings import ServerSettings
from tests.conftest import free_port
from tests.deploy.system import require_binary
from tests.server.conftest import start_server

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "moe-serve.json"


def dashboard_expressions() -> list[str]:
    return [target["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for target in panel["targets"]]


def test_dashboard_json_is_what_the_builder_writes() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_dashboard", ROOT / "deploy" / "grafana" / "build_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    assert json.loads(DASHBOARD.read_text()) == module.build()


def scrape_config(tmp_path: Path, target: str, key: str) -> Path:
    """deploy/prometheus.yml aimed at `target`, its credentials file (the compose secret) written here."""
    (tmp_path / "api_key").write_text(key + "\n")
    config = (ROOT / "deploy" / "prometheus.yml").read_text()
    assert "credentials_file: /run/secrets/api_key" in config  # the compose file's secret
    config = (
        config.replace('["moe-serve:8000"]', f'["{target}"]')
        .replace("scrape_interval: 5s", "scrape_interval: 1s")
        .replace("/run/secrets/api_key", str(tmp_path / "api_key"))
    )
    (tmp_path / "prometheus.yml").write_text(config)
    return tmp_path / "prometheus.yml"


def test_promtool_accepts_the_scrape_config(tmp_path: Path) -> None:
    promtool = require_binary("promtool", "prometheus")
    config = scrape_config(tmp_path, "127.0.0.1:8000", "k")
    result = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_dashboard_query_returns_data_from_a_real_prometheus(tmp_path: Path, artifacts) -> None:
    prometheus = require_binary("prometheus", "prometheus")
    QualityTable(tuple(QualityRow("shakespeare", k, "bits_per_byte", 3.0 - 0.1 * k) for k in (1, 2, 4))).merge_into(
        artifacts["lm"] / "quality.json"
    )
    key = "scrape-key"  # /metrics is protected with the API key, as in the compose deployment
    # A latency target, so that "auto" is served and its k exported.
    engine = EngineConfig(target_itl_ms=1000)
    server = start_server(
        ServerSettings(models=(str(artifacts["lm"]), str(artifacts["clf"])), api_key=key, engine=engine)
    )
    config = scrape_config(tmp_path, server.url.removeprefix("http://"), key)
    port = free_port()
    process = subprocess.Popen(
        [
            prometheus,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    api = f"http://127.0.0.1:{port}/api/v1/query"
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {key}"}) as http:
            deadline = time.time() + 12
            while time.time() < deadline:  # traffic at two k (and some errors) while Prometheus scrapes every second
                for k in (1, 4):
                    http.post(
                        "/v1/completions",
                        json={"model": "tiny-lm", "prompt": "Act I.", "max_tokens": 8, "experts_per_token": k},
                    )
                    http.post(
                        "/v1/classify",
                        json={"model": "tiny-clf", "input": "Exit, pursued by a bear.", "experts_per_token": k},
                    )
                auto = {"model": "tiny-lm", "prompt": "Act II.", "max_tokens": 8, "experts_per_token": "auto"}
                assert http.post("/v1/completions", json=auto).status_code == 200
                http.post("/v1/completions", json={"model": "tiny-lm", "prompt": "x", "experts_per_token": 99})
                time.sleep(0.2)
        time.sleep(3)  # a few more scrapes
        missing = []
        for expr in dashboard_expressions():
            query = expr.replace('"$model"', '".*"').replace("$__rate_interval", "30s")
            body = httpx.get(api, params={"query": query}, timeout=30).json()
            assert body["status"] == "success", (expr, body)
            if not body["data"]["result"]:
                missing.append(expr)
        assert not missing, f"queries without data: {missing}"
        by_k = httpx.get(
            api, params={"query": 'count by (k) (moe_serve_time_to_first_token_seconds_bucket{model="tiny-lm"})'}
        ).json()
        assert {r["metric"]["k"] for r in by_k["data"]["result"]} >= {"1", "4"}
        assert re.search(r"\$model", DASHBOARD.read_text())  # the template variable is used
    finally:
        process.terminate()
        process.wait(timeout=20)
        server.stop()
