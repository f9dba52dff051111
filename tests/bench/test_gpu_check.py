"""The device check (benchmarks/gpu_check.py, docs/gpu.md) off a GPU: its dry run, the roofline's byte count,
the carried wheels it installs, and its benchmark path on a tiny model on the CPU (the GPU run itself cannot
be tested here: no CI machine has a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check
from benchmarks.gpu_check import MoEShape

ROOT = Path(__file__).resolve().parents[2]


def run_check(out: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(out), *extra]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.skipif(gpu_check.shutil.which("nvidia-smi") is not None, reason="a dry run needs a machine without a GPU")
def test_the_dry_run_probes_then_skips_every_gpu_phase_naming_cuda(tmp_path: Path) -> None:
    done = run_check(tmp_path / "out", "--wheels", str(tmp_path / "no-wheels"), "--budget-s", "60")
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert tuple(report["phases"]) == gpu_check.PHASES
    assert report["phases"]["probe"]["status"] == "ok"
    assert report["phases"]["probe"]["data"]["cuda"]["available"] is False
    for name in ("tests", "bench-large", "bench-medium"):
        assert report["phases"][name]["status"] == "skipped"
        assert "CUDA" in report["phases"][name]["reason"]
    assert all(goal["value"] is None and goal["met"] is None for goal in report["goals"])
    table = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "| bench-large | skipped |" in table
    assert done.stdout.rstrip().endswith(table.rstrip().splitlines()[-1])  # the table is printed last
    assert len(list((tmp_path / "out").iterdir())) <= 8  # what the device tool brings back


def test_decode_bytes_match_a_hand_count() -> None:
    # vocab 10, hidden 8, 4 heads of 2 (2 KV heads), 3 experts of 6, 2 layers
    shape = MoEShape(vocab=10, hidden=8, intermediate=6, layers=2, heads=4, kv_heads=2, experts=3, top_k=2)
    q_o = 2 * 8 * 8  # q: 8 -> 4 x 2, o: back
    k_v = 2 * 8 * 4  # k, v: 8 -> 2 x 2 each
    norms = 2 * 8
    expert = 3 * 8 * 6  # gate, up, down
    router_bytes = 4 * 3 * 8  # fp32
    for k in (1, 2, 3):
        per_layer = 2 * (q_o + k_v + norms + k * expert) + router_bytes
        expected = 2 * per_layer + 2 * (8 + 8 + 10 * 8)  # + embedding row, final norm, LM head (bf16)
        assert shape.decode_bytes(k) == expected
    assert shape.params() == 2 * 10 * 8 + 8 + 2 * (q_o + k_v + norms + 3 * 8 + 3 * expert)


def test_the_large_model_is_3_to_7_billion_parameters_and_the_roofline_reads_a_third_of_it_at_k2() -> None:
    large = MoEShape.of(gpu_check.LARGE)
    assert 3e9 <= large.params() <= 7e9
    assert 0.25 < large.decode_bytes(2) / (2 * large.params()) < 0.4


def test_roofline_fraction_is_bytes_over_step_time_over_copy_bandwidth() -> None:
    shape = MoEShape.of(gpu_check.PRESETS["tiny"])
    data = {"copy": {"copy_gb_s": 1000.0}, "graphs": {"decode": {"1": {"2": {"step_ms": 2.0}}}}}
    fraction = gpu_check.roofline(data, shape)["graphs"]["2"]
    assert fraction == pytest.approx(shape.decode_bytes(2) / 2e-3 / 1e12)


@pytest.mark.parametrize(
    ("name", "version", "fits"),
    [
        ("pydantic-2.14.4-py3-none-any.whl", (3, 11), True),
        ("pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", (3, 12), True),
        ("pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", (3, 11), False),
        ("thing-1.0-cp312-cp312-macosx_11_0_arm64.whl", (3, 12), False),
        ("not-a-wheel.zip", (3, 12), False),
    ],
)
def test_only_the_wheels_this_interpreter_can_install_are_installed(name: str, version: tuple, fits: bool) -> None:
    assert gpu_check.wheel_fits(name, version, machine="x86_64") is fits


def test_the_gpu_tests_are_found_by_their_mark() -> None:
    files = gpu_check.gpu_test_files()
    assert files and all(f.startswith("tests/") and "pytest.mark.gpu" in (ROOT / f).read_text() for f in files)
    assert "tests/bench/test_gpu_check.py" not in files  # it names the mark in its text only


@pytest.mark.slow
def test_the_gpu_phases_run_end_to_end_on_a_tiny_model_on_the_cpu(tmp_path: Path, monkeypatch) -> None:
    """What a GPU run does, with the CPU standing in for the device: the tests phase over the gpu-marked files
    (each skips itself without CUDA), and the bench worker on a tiny model (transformers' model converted in
    memory through exporters.hf gives the same greedy tokens in moe-serve in fp32), then the report."""
    monkeypatch.setattr(gpu_check, "why_no_gpu", lambda probe: None)
    monkeypatch.setattr(gpu_check.Check, "bench_models", ("large",))
    real_worker = gpu_check.Check.worker

    def on_the_cpu(self, phase, argv):
        if "bench" in argv:
            argv = ["--worker", "bench", "--model", "tiny", "--device", "cpu", "--quick"]
        real_worker(self, phase, argv)

    monkeypatch.setattr(gpu_check.Check, "worker", on_the_cpu)
    args = gpu_check.parse_args(["--out", str(tmp_path / "out"), "--wheels", str(tmp_path / "none")])
    report = gpu_check.Check(args).run()

    tests = report["phases"]["tests"]
    assert tests["status"] == "ok" and tests["data"]["tests"] > 0 and tests["data"]["skipped"] == tests["data"]["tests"]
    bench = report["phases"]["bench-large"]
    assert bench["status"] == "ok", bench["reason"]
    data = bench["data"]
    assert "error" not in data and data["weights"]["tensors"] > 0
    parity = data["graphs"]["parity"]
    assert parity["matching_prefix"] == [parity["tokens"]] * parity["prompts"]
    for mode in ("graphs", "eager"):
        cells = data[mode]["decode"]
        assert set(cells) == {"1", "4"} and set(cells["4"]) == {"1", "2", "N", "mixed"}
    assert data["prefill"]["prefill_tok_s"] > 0 and set(data["hf"]) == {"1", "4"}
    table = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "### large" in table and "| tests | ok |" in table
    assert {p.name for p in (tmp_path / "out").iterdir()} == {
        "gpu_check.json",
        "gpu_check.md",
        "gpu_check.log",
        "gpu_tests.log",
        "gpu_tests.xml",
    }


@pytest.mark.slow
@pytest.mark.skipif(
    gpu_check.shutil.which("nvidia-smi") is not None, reason="with a GPU the profile runs the large model on CUDA"
)
def test_the_step_profile_runs_its_eager_part_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks.gpu_profile off a GPU: the tiny model's eager step periods and the profiler's table, written
    to OUT (the graph replays and the A/B need CUDA)."""
    command = [sys.executable, "-m", "benchmarks.gpu_profile", "--out", str(tmp_path), "--tokens", "4"]
    command += ["--profile-tokens", "2"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "gpu_profile.txt").read_text()
    assert "# gpu_profile: tiny on cpu" in text
    for batch in (1, 4):
        assert f"eager batch {batch} k=2: {{'steps': 4, 'step_period_ms': " in text
    assert "## eager, batch 1, k=2, 2 tokens, by cpu_time_total" in text and "Self CPU time total" in text
