"""llama.cpp in the side-by-side benchmark (benchmarks/llamacpp.py, docs/benchmarks.md): the formats table and
k lists off any engine; then, where `make llamacpp` has built llama.cpp in the benchmark cache, its greedy tokens
against moe-serve's on the tiny model at fp32 and one engine worker (skipped without the build: building
takes minutes, which no test spends)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import llamacpp
from benchmarks.models import DEFAULT_CACHE, BenchModel
from benchmarks.run import formats_table

ROOT = Path(__file__).resolve().parents[2]
built = pytest.mark.skipif(
    not llamacpp.tree(DEFAULT_CACHE).built(), reason=f"llama.cpp is not built in {DEFAULT_CACHE} (make llamacpp)"
)


def test_n_in_a_k_list_stands_for_every_expert(tmp_path: Path) -> None:
    model = BenchModel("tiny", tmp_path / "hf", tmp_path / "artifact", {"num_local_experts": 8}, tmp_path)
    assert model.ks("1,2,N") == [1, 2, 8]


def test_the_formats_table_gives_moe_serve_over_llama_cpp_with_the_loads_and_why_a_cell_is_empty() -> None:
    def cell(rate: float) -> dict:
        return {"1": {"min": rate, "median": rate, "max": rate, "load_average": [1.5, 2.25]}}

    formats = {
        "fp32": {"2": {"moe-serve": cell(600), "hf": cell(100), "llama.cpp": cell(300)}},
        "int8": {"2": {"moe-serve": "no int8 artifact: quantize_artifact unavailable", "llama.cpp": cell(500)}},
    }
    lines = formats_table("tiny", formats)
    assert "| fp32 | 2 | 1 | 600 [1.5, 2.2] | 100 [1.5, 2.2] | 300 [1.5, 2.2] | 2.00x | 2.00x (llama.cpp) |" in lines
    assert "| int8 | 2 | 1 | - | - | 500 [1.5, 2.2] | - | - |" in lines
    assert "- int8, k=2, moe-serve: no int8 artifact: quantize_artifact unavailable" in lines


@pytest.mark.slow
@built
def test_llama_cpp_greedy_tokens_equal_moe_serves_at_fp32() -> None:
    command = [sys.executable, "-m", "benchmarks.llamacpp_parity", "--models", "tiny", "--prompts", "2"]
    done = subprocess.run(command + ["--new-tokens", "16"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert done.stdout.count("batched and alone: equal") == 3  # k = 1, 2, 8


@pytest.mark.slow
@built
def test_the_llama_cpp_worker_reports_tokens_per_second_at_each_batch() -> None:
    gguf = llamacpp.gguf_path(BenchModel("tiny", DEFAULT_CACHE / "tiny" / "hf", Path(), {}, DEFAULT_CACHE), "f32")
    if not gguf.is_file():
        pytest.skip(f"{gguf} not converted (make llamacpp)")
    command = [sys.executable, "-m", "benchmarks.engines", "llama.cpp", str(gguf), "--batches", "1,4", "--ks", "1"]
    done = subprocess.run(command + ["--reps", "1", "--new-tokens", "8"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.split("RESULTS ", 1)[1])
    assert set(results["1"]) == {"1", "4"} and all(rate > 0 for rates in results["1"].values() for rate in rates)
