"""The moe-serve command line: every command in-process through the one entry point (`main`), and one
smoke test of the installed console script as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

from moe_serve.cli import main
from tests.conftest import classifier_config


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def run(capsys):
    def run(*args: str, check: bool = True) -> Result:
        code = main(list(args))
        out, err = capsys.readouterr()
        if check:
            assert code == 0, err
        return Result(code, out, err)

    return run


@pytest.mark.slow
def test_console_script_is_the_same_program() -> None:
    """The installed `moe-serve` and `python -m moe_serve` start, parse and answer (a real subprocess)."""
    script = subprocess.run(
        ["moe-serve", "models", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": f"{sys.prefix}/bin"},
    )
    assert script.returncode == 0, script.stderr
    module = subprocess.run(
        [sys.executable, "-m", "moe_serve", "models", "--json"], capture_output=True, text=True, timeout=120
    )
    assert json.loads(script.stdout) == json.loads(module.stdout) and "shakespeare-smoe" in json.loads(module.stdout)


def test_generate_json_reports_k_and_completions(make_artifact, run) -> None:
    path = make_artifact()
    out = json.loads(
        run(
            "generate",
            str(path),
            "--prompt",
            "ROMEO.",
            "--prompt",
            "JULIET.",
            "--max-tokens",
            "5",
            "-k",
            "3",
            "--seed",
            "1",
            "--json",
        ).stdout
    )
    assert [o["prompt"] for o in out] == ["ROMEO.", "JULIET."]
    assert all(o["experts_per_token"] == 3 for o in out)
    assert all(c["num_tokens"] <= 5 for o in out for c in o["completions"])


def test_k_auto_on_the_command_line(make_artifact, run, capsys) -> None:
    path = str(make_artifact())
    args = ("generate", path, "--prompt", "ROMEO.", "--max-tokens", "3", "-k", "auto", "--json")
    out = json.loads(run(*args, "--target-itl-ms", "1000").stdout)
    assert out[0]["experts_per_token"] is None and out[0]["completions"]  # "auto": no one fixed k
    scored = json.loads(run("score", path, "To be", "-k", "auto", "--target-itl-ms", "1000", "--json").stdout)
    assert scored[0]["experts_per_token"] is None and scored[0]["experts"]["tokens"] > 0
    refused = run(*args, check=False)
    assert refused.returncode == 2 and "needs a latency target" in refused.stderr
    with pytest.raises(SystemExit) as exit_info:  # argparse: usage and the error
        main(["generate", path, "--prompt", "x", "-k", "three"])
    assert exit_info.value.code == 2 and "not a k: 'three'" in capsys.readouterr().err


def test_score_and_classify(make_artifact, run) -> None:
    lm = make_artifact()
    scored = json.loads(run("score", str(lm), "To be, or not to be", "--json").stdout)
    assert scored[0]["num_bytes"] == 19 and scored[0]["bits_per_byte"] > 0 and scored[0]["experts_per_token"] == 2
    clf = make_artifact(classifier_config())
    text = run("classify", str(clf), "Now is the winter of our discontent", "-k", "2").stdout
    label = text.split("\t")[0]
    assert label in {"comedy", "history", "tragedy"} and "approximate" in text


def test_inspect_lists_experts_and_active_parameters(make_artifact, run) -> None:
    path = make_artifact()
    summary = json.loads(run("inspect", str(path), "--json").stdout)
    assert summary["moe"]["num_experts"] == 4
    assert summary["moe"]["experts_per_token"] == {"default": 2, "min": 1, "max": 4}
    active = summary["parameters"]["active_per_token"]
    assert list(active) == ["1", "2", "3", "4"]
    step = summary["parameters"]["per_expert_per_layer"]
    assert active["4"] == summary["parameters"]["total"] and active["2"] - active["1"] == step
    human = run("inspect", str(path)).stdout
    assert "experts_per_token: default 2, allowed 1..4" in human


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["eval", "{model}", "--backend", "onnxruntime", "--write-artifact"],
            "--write-artifact writes the artifact's quality.json, but --backend onnxruntime evaluates an export",
        ),
        (["generate", "{model}", "--prompt", "x", "-k", "0"], "experts_per_token must be at least 1, got 0"),
        (["generate", "{model}", "--prompt", "x", "-k", "5"], "experts_per_token must be between 1 and 4, got 5"),
        (["generate", "{model}", "--prompt", "x", "--max-tokens", "0"], "max_tokens must be at least 1"),
        (["score", "/nonexistent/model", "x"], "no artifact directory '/nonexistent/model'"),
    ],
)
def test_errors_are_one_line_without_traceback(make_artifact, run, args: list[str], message: str) -> None:
    path = make_artifact()
    result = run(*[a.format(model=path) for a in args], check=False)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_eval_writes_to_its_output_dir_never_into_a_bundled_demo(run, tmp_path) -> None:
    from moe_serve.registry import resolve_model

    bundled = resolve_model("genre-topk") / "quality.json"
    before = bundled.read_bytes()
    args = ["eval", "genre-topk", "--k", "1,2", "--max-items", "6", "--output-dir", str(tmp_path), "--json"]
    out = json.loads(run(*args).stdout)
    assert {(r["k"], r["metric"]) for r in out["results"]} == {(k, m) for k in (1, 2) for m in ("accuracy", "macro_f1")}
    assert out["files"]["quality_json"] == {"genre-topk": [str(tmp_path / "genre-topk" / "quality.json")]}
    assert (tmp_path / "quality.csv").is_file() and (tmp_path / "quality_vs_k.png").is_file()
    refused = run(*args, "--write-artifact", check=False)
    assert refused.returncode == 2 and "bundled demo: its quality table is read-only data" in refused.stderr
    assert bundled.read_bytes() == before


def test_eval_stored_prints_each_recipes_mean_and_std_over_seeds(run, tmp_path) -> None:
    """`eval --stored` reads what recipes.build_demos wrote into the provenance (no evaluation), and a
    model without those figures is refused by name."""
    import shutil

    from moe_serve.registry import resolve_model

    plain = tmp_path / "genre-plain"
    shutil.copytree(resolve_model("genre-topk"), plain)
    manifest = json.loads((plain / "config.json").read_text())
    manifest["provenance"].pop("seeds", None)  # a model trained outside recipes.build_demos
    (plain / "config.json").write_text(json.dumps(manifest))
    seeded = tmp_path / "genre-seeded"
    shutil.copytree(plain, seeded)
    manifest["provenance"]["seeds"] = {
        "recipe": "topk-clf",
        "seeds": [0, 1, 2],
        "bundled_seed": 2,
        "chosen_by": "highest mean accuracy",
        "trained_k": [2],
        "quality": [
            {"k": 1, "metric": "accuracy", "mean": 0.5123, "std": 0.0211, "values": {"0": 0.49, "1": 0.52, "2": 0.53}},
            {"k": 2, "metric": "accuracy", "mean": 0.6, "std": None, "values": {"2": 0.6}},
        ],
    }
    (seeded / "config.json").write_text(json.dumps(manifest))
    out = run("eval", "--stored", str(seeded)).stdout
    assert "[sequence_classification]" in out and "accuracy (mean ± std over seeds)" in out
    line = next(line for line in out.splitlines() if line.startswith("genre-seeded"))
    assert "0.5123 ± 0.0211*" in line and "0.6000 " in line and line.endswith("3 (2)")  # k = 1: never trained
    assert "*: a k that recipe never trained at" in out
    refused = run("eval", "--stored", str(plain), check=False)
    assert refused.returncode == 2 and "carries no figures over training seeds" in refused.stderr
    nothing = run("eval", check=False)
    assert nothing.returncode == 2 and "name at least one MODEL" in nothing.stderr


@pytest.mark.slow
def test_eval_compares_weight_formats_with_kl_from_the_floats(run, tmp_path) -> None:
    """--compare-weights: each format's bits per byte at each k beside the floats', and its KL from them (bf16
    of bf16-stored weights holds the same values: only the order of additions differs, as the C++ kernel
    takes bf16 weights at every row count where fp32 ones go to MKL above 64; int4 moves the distributions
    more than int8)."""
    args = ["eval", "shakespeare-smoe", "--k", "1,2", "--max-items", "4", "--output-dir", str(tmp_path), "--json"]
    out = json.loads(run(*args, "--compare-weights", "bf16,int8,int4").stdout)
    rows = {(r.get("weights"), r["k"], r["metric"]): r["value"] for r in out["results"]}
    for k in (1, 2):
        assert rows[("bf16", k, "bits_per_byte")] == pytest.approx(rows[(None, k, "bits_per_byte")], rel=1e-6)
        assert abs(rows[("bf16", k, "kl_from_float")]) < 1e-6
        assert 0 < rows[("int8", k, "kl_from_float")] < rows[("int4", k, "kl_from_float")]
    assert "int4,shakespeare" in (tmp_path / "quality.csv").read_text()
    refused = run(*args, "--compare-weights", "int3", check=False)
    assert refused.returncode == 2 and "--compare-weights takes bf16, int8, int4" in refused.stderr
    assert "got 'int3'" in refused.stderr
    for entry in ("int8:bf16", "int8:int4"):  # no bf16 activations for int8 weights; no int4 activations
        refused = run(*args, "--compare-weights", entry, check=False)
        assert refused.returncode == 2 and f"got {entry!r}" in refused.stderr


@pytest.mark.slow
def test_eval_compares_int8_activations_with_the_formats_fp32_ones(run, tmp_path) -> None:
    """int8:int8 (int8 weights, int8 activations): its own rows, labelled so, its KL from the floats and from int8
    weights with fp32 activations (loaded for the comparison when not asked for itself), written to quality.json."""
    args = ["eval", "shakespeare-smoe", "--k", "1,2", "--max-items", "4", "--output-dir", str(tmp_path), "--json"]
    out = json.loads(run(*args, "--compare-weights", "int8:int8,int4:fp32").stdout)
    rows = {(r.get("weights"), r["k"], r["metric"]): r["value"] for r in out["results"]}
    for k in (1, 2):
        assert abs(rows[("int8:int8", k, "bits_per_byte")] - rows[(None, k, "bits_per_byte")]) < 0.01
        assert 0 < rows[("int8:int8", k, "kl_from_fp32_activations")] < 0.01
        assert 0 < rows[("int8:int8", k, "kl_from_float")] < 0.01
        assert 0.9 < rows[("int8:int8", k, "topk_agreement_with_fp32_activations")] <= 1.0
        worst = rows[("int8:int8", k, "topk_agreement_with_fp32_activations_worst_layer")]
        assert 0.8 < worst <= rows[("int8:int8", k, "topk_agreement_with_fp32_activations")]
        assert ("int4", k, "bits_per_byte") in rows  # int4:fp32 is int4
    stored = json.loads((tmp_path / "shakespeare-smoe" / "quality.json").read_text())
    assert any(r.get("weights") == "int8:int8" for r in stored["results"])
