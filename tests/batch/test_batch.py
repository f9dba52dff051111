"""`moe-serve batch`: OpenAI batch lines in and out (each output line in the strict OpenAI shape), k sweeps
(`<custom_id>:k<k>`), bad lines, duplicates, resume after kill -9, quality rows from a labelled sweep."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from moe_serve.batch.jsonl import read_inputs
from moe_serve.batch.quality import labels_of, quality_rows
from moe_serve.batch.runner import run_batch
from moe_serve.config import EngineConfig
from tests.conftest import classifier_config, lm_config


def line(custom_id: str, url: str, body: dict, **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


def assert_strict(lines: list[dict]) -> None:
    """What a strict OpenAI batch-output schema accepts: exact key sets, moe-serve's extensions only inside
    the response body; and custom_ids unique, so a consumer can key the results by them."""
    for x in lines:
        assert set(x) == {"id", "custom_id", "response", "error"}, x
        assert isinstance(x["id"], str) and isinstance(x["custom_id"], str)
        assert (x["response"] is None) != (x["error"] is None), x
        if x["response"] is not None:
            assert set(x["response"]) == {"status_code", "request_id", "body"}
            assert isinstance(x["response"]["status_code"], int) and isinstance(x["response"]["body"], dict)
        else:
            assert set(x["error"]) == {"code", "message"}
    assert len({x["custom_id"] for x in lines}) == len(lines)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from moe_serve.testing import create_random_artifact

    root = tmp_path_factory.mktemp("batch-models")
    return {
        "lm": create_random_artifact(root / "lm", lm_config(), seed=3),
        "clf": create_random_artifact(root / "clf", classifier_config(), seed=4),
    }


def test_every_endpoint_bad_lines_and_duplicates(tmp_path: Path, models) -> None:
    lm, clf = str(models["lm"]), str(models["clf"])
    inputs = tmp_path / "in.jsonl"
    inputs.write_text(
        "\n".join(
            [
                line("gen", "/v1/completions", {"prompt": ["ROMEO.", "JULIET."], "max_tokens": 4, "temperature": 0}),
                line("score", "/v1/score", {"input": "To be, or not to be"}),
                line("clf", "/v1/classify", {"model": clf, "input": ["Out, damned spot!"]}),
                "{broken json",
                line("emb", "/v1/embeddings", {"input": "x"}),
                line("gen", "/v1/completions", {"prompt": "again"}),
                line("badk", "/v1/completions", {"prompt": "x", "experts_per_token": 9}),
                line("badtype", "/v1/score", {"input": 5}),
            ]
        )
        + "\n"
    )
    output = tmp_path / "out.jsonl"
    summary, written = run_batch(inputs, output, default_model=lm, models=(clf,), ks=[1, 4], progress=False)
    lines = [json.loads(raw) for raw in output.read_text().splitlines()]
    assert len(lines) == len(written) == 3 + 5 * 2  # three error lines, five runnable lines at two k
    assert_strict(lines)
    by_key = {x["custom_id"]: x for x in lines if x["error"] is None}
    assert set(by_key) == {f"{c}:k{k}" for c in ("gen", "score", "clf", "badk", "badtype") for k in (1, 4)}
    gen = by_key["gen:k4"]["response"]
    assert (
        gen["status_code"] == 200
        and len(gen["body"]["choices"]) == 2
        and gen["body"]["usage"]["experts_per_token"] == 4
    )
    assert by_key["score:k1"]["response"]["body"]["data"][0]["num_bytes"] == 19
    assert by_key["score:k1"]["response"]["body"]["usage"]["experts_per_token"] == 1  # the k used, in the body
    assert by_key["clf:k4"]["response"]["body"]["model"] == clf  # the body's model wins over --model
    bad_k = by_key["badk:k1"]["response"]
    assert bad_k["status_code"] == 200  # the sweep's k replaces the body's own
    bad_type = by_key["badtype:k1"]["response"]
    assert bad_type["status_code"] == 400 and bad_type["body"]["error"]["param"] == "input"
    errors = {x["error"]["code"]: x for x in lines if x["error"]}
    assert set(errors) == {"invalid_json", "invalid_request", "duplicate_custom_id"}
    assert "unknown url '/v1/embeddings'" in errors["invalid_request"]["error"]["message"]
    assert errors["duplicate_custom_id"]["custom_id"] == "line-6"  # "gen" names the answered line
    assert "custom_id 'gen' was already used" in errors["duplicate_custom_id"]["error"]["message"]
    assert summary.duplicates == ["gen"] and summary.requests == 10 and summary.errors == 3 + 2
    # A second run finds everything done and writes nothing.
    summary2, written2 = run_batch(inputs, output, default_model=lm, models=(clf,), ks=[1, 4], progress=False)
    assert written2 == [] and summary2.skipped == 10


def test_k_out_of_range_without_sweep_is_a_400_naming_the_parameter(tmp_path: Path, models) -> None:
    inputs = tmp_path / "in.jsonl"
    inputs.write_text(line("badk", "/v1/completions", {"prompt": "x", "experts_per_token": 9}) + "\n")
    _, written = run_batch(inputs, tmp_path / "out.jsonl", default_model=str(models["lm"]), progress=False)
    error = written[0]["response"]["body"]["error"]
    assert (
        written[0]["response"]["status_code"] == 400
        and error["param"] == "experts_per_token"
        and "between 1 and 4" in error["message"]
    )


def test_poison_lines_fail_alone_and_a_rerun_resumes(tmp_path: Path, models) -> None:
    lm, clf = str(models["lm"]), str(models["clf"])
    raw = [
        line("ok", "/v1/completions", {"prompt": "x", "max_tokens": 2}).encode(),
        line("classifier", "/v1/completions", {"model": clf, "prompt": "x"}).encode(),
        b'{"custom_id": "latin-1", "method": "POST", "url": "/v1/score", "body": {"input": "caf\xe9"}}',
        b'{"custom_id": "surrogate", "method": "POST", "url": "/v1/completions", "body": {"prompt": "\\ud800"}}',
        b'{"custom_id": "\\udc00", "method": "POST", "url": "/v1/score", "body": {"input": "x"}}',
        line("top_k", "/v1/completions", {"prompt": "x", "top_k": 2**63, "temperature": 1}).encode(),
        line("seed", "/v1/completions", {"prompt": "x", "seed": 2**64}).encode(),
        line("etc", "/v1/completions", {"model": "/etc", "prompt": "x"}).encode(),
        line("nowhere", "/v1/completions", {"model": "/no/such/path", "prompt": "x"}).encode(),
        line("ok-too", "/v1/score", {"input": "fine"}).encode(),
    ]
    inputs, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inputs.write_bytes(b"\n".join(raw) + b"\n")
    summary, written = run_batch(inputs, output, default_model=lm, models=(clf,), progress=False)
    lines = [json.loads(raw) for raw in output.read_text(encoding="utf-8").splitlines()]
    assert len(lines) == len(written) == 10
    assert_strict(lines)
    status = {x["custom_id"]: (x["response"] or {}).get("status_code") for x in lines}
    codes = {x["custom_id"]: x["error"]["code"] for x in lines if x["error"]}
    assert status["ok"] == status["ok-too"] == 200
    assert status["classifier"] == status["surrogate"] == status["top_k"] == status["seed"] == 400
    assert codes == {"line-3": "invalid_encoding", "line-5": "invalid_request"}
    # A model path outside the allowed set is refused alike whether or not it exists.
    refusal = {x["custom_id"]: x["response"]["body"]["error"] for x in lines if x["custom_id"] in ("etc", "nowhere")}
    assert status["etc"] == status["nowhere"] == 404
    assert refusal["etc"]["message"].replace("/etc", "?") == refusal["nowhere"]["message"].replace("/no/such/path", "?")
    assert summary.errors == 8
    again, rewritten = run_batch(inputs, output, default_model=lm, models=(clf,), progress=False)
    assert rewritten == [] and again.skipped == 8


@pytest.mark.parametrize(
    "args,message",
    [
        (["--chunk-size", "0"], "chunk_size must be at least 1, got 0"),
        (["--chunk-size", "-1"], "chunk_size must be at least 1, got -1"),
        (["-o", "{tmp}"], "is a directory"),
        (["-o", "/dev/full"], "No space left on device"),
        (["-o", "/sys/moe-serve.jsonl"], "cannot write /sys/moe-serve.jsonl: Permission denied"),
        (["-o", "{tmp}/in.jsonl"], "is not a batch output (line 1 is not a result line)"),
    ],
    ids=["chunk 0", "chunk -1", "directory", "full disk", "read-only", "not an output"],
)
def test_batch_command_errors_are_one_line(tmp_path: Path, models, capsys, args: list[str], message: str) -> None:
    from moe_serve.cli import main

    inputs = tmp_path / "in.jsonl"
    inputs.write_text(line("a", "/v1/score", {"input": "x"}) + "\n")
    output = ["-o", str(tmp_path / "out.jsonl")]
    argv = ["batch", "-i", str(inputs), "--model", str(models["lm"]), *output, *[a.format(tmp=tmp_path) for a in args]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_output_to_a_pipe_does_not_try_to_resume_from_it(tmp_path: Path, models) -> None:
    inputs = tmp_path / "in.jsonl"
    inputs.write_text(line("a", "/v1/score", {"input": "to stdout"}) + "\n")
    argv = ["batch", "-i", str(inputs), "--model", str(models["lm"]), "-o", "/dev/stdout", "--json"]
    result = subprocess.run([sys.executable, "-m", "moe_serve", *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[0])["custom_id"] == "a"


@pytest.mark.slow
def test_resume_after_kill_9_loses_and_duplicates_nothing(tmp_path: Path, models) -> None:
    inputs = tmp_path / "in.jsonl"
    inputs.write_text(
        "\n".join(
            line(
                f"req-{i}",
                "/v1/completions",
                {"prompt": f"Line {i}: " + "and " * (i % 7), "max_tokens": 12, "temperature": 0, "ignore_eos": True},
            )
            for i in range(120)
        )
        + "\n"
    )
    output = tmp_path / "out.jsonl"
    command = [
        sys.executable,
        "-m",
        "moe_serve",
        "batch",
        "-i",
        str(inputs),
        "-o",
        str(output),
        "--model",
        str(models["lm"]),
        "--k",
        "1,3",
        "--chunk-size",
        "8",
        "--json",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and (not output.exists() or output.read_text().count("\n") < 40):
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    partial = output.read_text().count("\n")
    assert 40 <= partial < 240, partial  # killed mid-run
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["skipped"] >= partial - 1 and summary["requests"] == 240 - summary["skipped"]
    lines = [json.loads(raw) for raw in output.read_text().splitlines()]
    counts = Counter(x["custom_id"] for x in lines)
    assert set(counts) == {f"req-{i}:k{k}" for i in range(120) for k in (1, 3)}
    assert set(counts.values()) == {1}
    assert_strict(lines)
    # Same answers as an uninterrupted run.
    fresh = tmp_path / "fresh.jsonl"
    run_batch(inputs, fresh, default_model=str(models["lm"]), ks=[1, 3], engine_config=EngineConfig(), progress=False)
    texts = lambda path: {
        x["custom_id"]: x["response"]["body"]["choices"][0]["text"]
        for x in map(json.loads, path.read_text().splitlines())
    }  # noqa: E731
    assert texts(output) == texts(fresh)


@pytest.mark.slow
def test_quality_rows_from_a_labelled_sweep(tmp_path: Path, models) -> None:
    clf = str(models["clf"])
    inputs = tmp_path / "labelled.jsonl"
    inputs.write_text(
        "\n".join(
            [
                line("x1", "/v1/classify", {"input": "My kingdom for a horse!"}, label="history"),
                line("x2", "/v1/classify", {"input": "If music be the food of love"}, label="comedy"),
                line("s1", "/v1/score", {"model": str(models["lm"]), "input": "To be, or not to be"}),
            ]
        )
        + "\n"
    )
    output = tmp_path / "out.jsonl"
    run_batch(inputs, output, default_model=clf, models=(str(models["lm"]),), ks=[1, 4], progress=False)
    assert_strict([json.loads(raw) for raw in output.read_text().splitlines()])
    rows = quality_rows(output, "labelled", labels_of(read_inputs(inputs, ks=[1, 4], allow_label=True)))
    metrics = {(r.model, r.metric, r.k) for r in rows}
    assert metrics == {
        (clf, "accuracy", 1),
        (clf, "accuracy", 4),
        (clf, "macro_f1", 1),
        (clf, "macro_f1", 4),
        (str(models["lm"]), "bits_per_byte", 1),
        (str(models["lm"]), "bits_per_byte", 4),
    }
    assert all(0 <= r.value <= 1 for r in rows if r.metric in ("accuracy", "macro_f1"))


@pytest.mark.slow
def test_ray_run_equals_local_run(tmp_path: Path, models) -> None:
    ray = pytest.importorskip("ray", reason="Ray is an optional extra (pip install 'moe-serve[ray]'); CI installs it")
    from moe_serve.batch.ray import ray_chunk_runner

    inputs = tmp_path / "in.jsonl"
    inputs.write_text(
        "\n".join(
            [
                line(f"g{i}", "/v1/completions", {"prompt": f"Act {i}.", "max_tokens": 6, "temperature": 0})
                for i in range(10)
            ]
            + [line(f"s{i}", "/v1/score", {"input": f"Scene {i} of the play"}) for i in range(6)]
            + ["not json"]
        )
        + "\n"
    )
    local, distributed = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    config = EngineConfig()
    run_batch(
        inputs, local, default_model=str(models["lm"]), ks=[1, 2], engine_config=config, chunk_size=4, progress=False
    )
    runner = ray_chunk_runner(None, 2, config)
    run_batch(
        inputs,
        distributed,
        default_model=str(models["lm"]),
        ks=[1, 2],
        chunk_size=4,
        progress=False,
        chunk_runner=runner,
    )
    assert not ray.is_initialized()

    def normalized(path: Path) -> dict:
        out = {}
        for x in map(json.loads, path.read_text().splitlines()):
            if x.get("response"):
                x["response"]["body"].pop("created", None)
            out[x["custom_id"]] = x
        return out

    local_lines, ray_lines = normalized(local), normalized(distributed)
    assert local_lines.keys() == ray_lines.keys() and len(local_lines) == 33
    for key in local_lines:
        a, b = local_lines[key], ray_lines[key]
        if a["response"] and "data" in a["response"]["body"]:  # scores: float sums may differ in the last bits
            for x, y in zip(a["response"]["body"]["data"], b["response"]["body"]["data"], strict=True):
                assert x["total_logprob"] == pytest.approx(y["total_logprob"], abs=1e-4)
        else:
            assert a == b, key
