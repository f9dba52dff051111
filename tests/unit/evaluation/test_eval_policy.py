"""`moe-serve eval --moe top_p=...`: adaptive-policy runs as quality rows at their measured mean k, in the
table, CSV, plot and quality.json (identified by their policy, not their k), never as fixed-k gauges."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_serve import LLM
from moe_serve.cli import main
from moe_serve.errors import ArtifactError, ValidationError
from moe_serve.evaluation.runner import evaluate
from moe_serve.evaluation.table import format_table
from moe_serve.moe_policy import MoEPolicy
from moe_serve.quality import QualityRow, QualityTable
from tests.conftest import NUM_EXPERTS, lm_config


def test_parse_sweep() -> None:
    assert [p.name for p in MoEPolicy.parse_sweep("top_p=0.6,0.8,1")] == ["top_p=0.6", "top_p=0.8", "top_p=1"]
    for bad, parameter in (("top_q=0.5", "moe"), ("top_p=", "moe"), ("top_p=x", "moe"), ("top_p=1.5", "moe.p")):
        with pytest.raises(ValidationError) as info:
            MoEPolicy.parse_sweep(bad)
        assert info.value.parameter == parameter


def test_quality_json_keeps_policy_rows_by_policy(tmp_path: Path) -> None:
    path = tmp_path / "quality.json"
    fixed = QualityRow("shakespeare", 2, "bits_per_byte", 2.5)
    first = QualityRow("shakespeare", 1.72, "bits_per_byte", 2.6, policy="top_p=0.8")
    QualityTable((fixed, first)).merge_into(path)
    again = QualityRow("shakespeare", 1.75, "bits_per_byte", 2.59, policy="top_p=0.8")  # a re-run moves its k
    table = QualityTable((again,)).merge_into(path)
    assert QualityTable.read(path).rows == table.rows == (fixed, again)
    document = json.loads(path.read_text())
    assert document["results"][1] == {
        "dataset": "shakespeare", "k": 1.75, "metric": "bits_per_byte", "value": 2.59, "policy": "top_p=0.8"
    }  # fmt: skip
    document["results"][0]["k"] = 1.5  # a fractional k needs a policy
    path.write_text(json.dumps(document))
    with pytest.raises(ArtifactError, match=r"results\[0\]\.k must be a positive integer"):
        QualityTable.read(path)


def test_eval_places_policies_at_their_mean_k(make_artifact) -> None:
    llm = LLM(make_artifact(lm_config(), seed=9))
    policies = MoEPolicy.parse_sweep("top_p=0.5,0.95")
    rows = evaluate(llm, [1, NUM_EXPERTS], max_items=4, progress=False, policies=policies)
    fixed = [r for r in rows if r.policy is None]
    adaptive = [r for r in rows if r.policy is not None]
    assert [r.k for r in fixed] == [1, NUM_EXPERTS]
    assert [r.policy for r in adaptive] == ["top_p=0.5", "top_p=0.95"]
    assert all(isinstance(r.k, float) and 1 <= r.k <= NUM_EXPERTS for r in adaptive)  # measured, not asked for
    assert adaptive[0].k < adaptive[1].k  # a higher p takes more experts
    assert "top_p=0.5  mean k=" in format_table(rows)


@pytest.mark.slow
def test_cli_eval_with_moe(make_artifact, tmp_path: Path, capsys) -> None:
    model = str(make_artifact(lm_config(), seed=9))
    args = ["eval", model, "--k", "2", "--moe", "top_p=0.7", "--max-items", "3", "--output-dir", str(tmp_path)]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    policies = {r.get("policy") for r in out["results"]}
    assert policies == {None, "top_p=0.7"}
    assert (tmp_path / "quality_vs_k.png").is_file()
    assert "top_p=0.7" in (tmp_path / "quality.csv").read_text()
    assert main([*args[:-2], "--moe", "top_p=2", "--output-dir", str(tmp_path)]) == 2
    assert "moe.p must be between" in capsys.readouterr().err
