"""vLLM's own load generator, `vllm bench serve`, unchanged, against a moe-serve server (benchmarks.vllm_bench_serve):
every request completes, none fails, and every token asked for comes back."""

from __future__ import annotations

import pytest

from benchmarks import vllm_bench_serve

pytestmark = pytest.mark.vllm_cpu


def test_vllm_bench_serve_runs_against_the_server_unchanged() -> None:
    result = vllm_bench_serve.main(
        ["--num-prompts", "12", "--input-len", "24", "--output-len", "8", "--max-concurrency", "4", "--timeout", "600"]
    )
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["total_output_tokens"] == 12 * 8  # --ignore-eos: each request generates all it asked for
    assert result["mean_ttft_ms"] > 0 and result["request_throughput"] > 0
