"""lm-evaluation-harness, unchanged, against a real moe-serve server: a multiple-choice (loglikelihood), a
rolling-perplexity and a generation task on held-out Shakespeare, the tokenizer taken from the server's
/tokenize, and k chosen per run through the model name. No model option beyond the server's address: the demos
have BOS, which lm-eval reads from /tokenizer_info and puts before a rolling window's first byte."""

from __future__ import annotations

import pytest

from moe_serve.config import EngineConfig
from moe_serve.evaluation.lm_eval_tasks import TASKS, write_tasks
from moe_serve.server.settings import ServerSettings
from tests.server.conftest import start_server

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

DOCS = 12


def evaluate(url: str, model: str, include_path: str) -> dict:
    from lm_eval.tasks import TaskManager

    args = f"model={model},base_url={url}/v1/completions,max_length=1024,num_concurrent=4,max_retries=1"
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=args,
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=include_path),
        limit=DOCS,
        log_samples=False,
    )
    return out["results"]


def test_lm_eval_runs_every_kind_of_task_at_two_ks(tmp_path) -> None:
    write_tasks(tmp_path, per_task=DOCS)
    running = start_server(ServerSettings(models=("shakespeare-smoe",), engine=EngineConfig(max_num_seqs=8)))
    try:
        at_1 = evaluate(running.url, "shakespeare-smoe:k1", str(tmp_path))
        at_max = evaluate(running.url, "shakespeare-smoe:k8", str(tmp_path))
    finally:
        running.stop()
    for results in (at_1, at_max):
        assert 0.0 <= results["shakespeare_next_line"]["acc,none"] <= 1.0
        assert 1.5 < results["shakespeare_ppl"]["bits_per_byte,none"] < 4.0  # learned: bytes are 8 bits at random
        assert 0.0 <= results["shakespeare_speaker"]["exact_match,none"] <= 1.0
    # The k reached the model: the two runs scored the same text differently.
    assert at_1["shakespeare_ppl"]["bits_per_byte,none"] != at_max["shakespeare_ppl"]["bits_per_byte,none"]
