"""`moe-serve batch` lines with a `moe` policy: answered as over HTTP, the mean k in each body's usage; a k
sweep cannot also fix the k of a line that asks for a policy (a 400 naming `moe`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_serve.batch.runner import run_batch
from moe_serve.layers.routers import router_config
from moe_serve.testing import create_random_artifact
from tests.batch.test_batch import assert_strict, line
from tests.conftest import classifier_config, lm_config, moe_config

POLICY = {"policy": "top_p", "p": 0.7, "min": 1, "max": 3}


@pytest.mark.slow
def test_policy_lines_report_their_mean_k(tmp_path: Path) -> None:
    lm = str(create_random_artifact(tmp_path / "lm", lm_config(), seed=3))
    topk = classifier_config(moe=moe_config(router=router_config("topk_uniform")))
    clf = str(create_random_artifact(tmp_path / "clf", topk, seed=4))
    inputs = tmp_path / "in.jsonl"
    inputs.write_text(
        "\n".join(
            [
                line("gen", "/v1/completions", {"prompt": "ROMEO.", "max_tokens": 4, "moe": POLICY}),
                line("score", "/v1/score", {"input": "To be, or not to be", "moe": POLICY}),
                line("clf", "/v1/classify", {"model": clf, "input": ["Out, damned spot!"], "moe": POLICY}),
                line("bad", "/v1/score", {"input": "To be", "moe": {**POLICY, "min": 4}}),
            ]
        )
        + "\n"
    )
    output = tmp_path / "out.jsonl"
    run_batch(inputs, output, default_model=lm, models=(clf,), progress=False)
    lines = [json.loads(raw) for raw in output.read_text().splitlines()]
    assert_strict(lines)
    by_id = {x["custom_id"]: x["response"] for x in lines}
    for custom_id in ("gen", "score", "clf"):
        assert by_id[custom_id]["status_code"] == 200, by_id[custom_id]
        usage = by_id[custom_id]["body"]["usage"]
        assert usage["experts_per_token"] is None and 1 <= usage["experts_per_token_mean"] <= 3
        assert usage["experts_per_token_details"]["max"] == 3
    assert by_id["bad"]["status_code"] == 400 and by_id["bad"]["body"]["error"]["param"] == "moe.min"

    swept = tmp_path / "swept.jsonl"
    run_batch(inputs, swept, default_model=lm, models=(clf,), ks=[2], progress=False)
    errors = [json.loads(raw)["response"]["body"]["error"] for raw in swept.read_text().splitlines()]
    assert sorted(e["param"] for e in errors) == ["moe", "moe", "moe", "moe.min"]  # the bad policy is bad first


@pytest.mark.slow
def test_quality_rows_of_policy_lines_sit_at_their_mean_k(tmp_path: Path) -> None:
    """`moe-serve batch --quality`: labelled classify and score lines under a policy give the policy's rows,
    at the mean of its lines' mean k, beside the fixed-k rows."""
    from moe_serve.batch.jsonl import read_inputs
    from moe_serve.batch.quality import labels_of, quality_rows

    lm = str(create_random_artifact(tmp_path / "lm", lm_config(), seed=3))
    topk = classifier_config(moe=moe_config(router=router_config("topk_uniform")))
    clf = str(create_random_artifact(tmp_path / "clf", topk, seed=4))
    texts = ["Out, damned spot!", "Now is the winter", "To be, or not to be", "Friends, Romans"]
    lines = []
    for i, text in enumerate(texts):
        lines.append(line(f"c{i}", "/v1/classify", {"model": clf, "input": [text], "moe": POLICY}, label="a"))
        lines.append(line(f"k{i}", "/v1/classify", {"model": clf, "input": [text], "experts_per_token": 2}, label="a"))
        lines.append(line(f"s{i}", "/v1/score", {"input": text, "moe": POLICY}))
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("\n".join(lines) + "\n")
    output = tmp_path / "out.jsonl"
    run_batch(inputs, output, default_model=lm, models=(clf,), progress=False)
    answers = [json.loads(raw) for raw in output.read_text().splitlines()]
    means = {x["custom_id"]: x["response"]["body"]["usage"]["experts_per_token_mean"] for x in answers}
    found = quality_rows(output, "labelled", labels_of(read_inputs(inputs, allow_label=True)))
    policy = "top_p=0.7,min=1,max=3"  # the resolved bounds name it
    accuracy = {(r.policy, r.k) for r in found if r.metric == "accuracy" and r.model == clf}
    assert {policy for policy, _ in accuracy} == {policy, None} and (None, 2) in accuracy
    clf_mean = next(k for p, k in accuracy if p == policy)
    assert clf_mean == pytest.approx(sum(means[f"c{i}"] for i in range(4)) / 4)
    bpb = [r for r in found if r.metric == "bits_per_byte"]
    assert len(bpb) == 1 and bpb[0].policy == policy
    assert bpb[0].k == pytest.approx(sum(means[f"s{i}"] for i in range(4)) / 4)
