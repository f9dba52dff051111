"""The load generator against a real server: one small cell, JSON and CSV written."""

from __future__ import annotations

import csv
import json

from moe_serve.loadtests.loadgen import main, percentile


def test_percentile() -> None:
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([1.0, 2.0], 0.99) == 2.0


def test_loadgen_reports_a_cell_per_concurrency_and_k(server, tmp_path) -> None:
    out_json, out_csv = tmp_path / "load.json", tmp_path / "load.csv"
    code = main(
        [
            "--url",
            server.url,
            "--model",
            "tiny-lm",
            "--concurrency",
            "1,4",
            "--k",
            "1,4",
            "--requests",
            "6",
            "--max-tokens",
            "8",
            "--json",
            str(out_json),
            "--csv",
            str(out_csv),
        ]
    )
    assert code == 0
    cells = json.loads(out_json.read_text())["cells"]
    assert [(c["concurrency"], c["k"]) for c in cells] == [(1, 1), (1, 4), (4, 1), (4, 4)]
    for c in cells:
        assert c["requests"] == 6 and c["errors"] == 0
        assert 0 < c["ttft_p50_s"] <= c["latency_p50_s"] and c["tokens_per_s"] > 0
    assert len(list(csv.DictReader(out_csv.open()))) == 4


def test_loadgen_refuses_non_loopback_targets() -> None:
    assert main(["--url", "http://10.0.0.1:8000", "--model", "m"]) == 2
