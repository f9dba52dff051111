"""The static decode path (engine.decode_graphs) run eagerly on CPU: the packing and padding a CUDA graph
replays, checked against the eager path on the same requests (docs/architecture.md, the GPU engine)."""

from __future__ import annotations

import pytest
import torch

from moe_serve import LLM, SamplingParams
from moe_serve.engine.decode_graphs import DecodeGraphs, bucket_sizes, unsupported_reason
from moe_serve.engine.model_runner import TorchRunner
from moe_serve.layers.routers import router_config
from tests.conftest import NUM_EXPERTS, classifier_config, lm_config, moe_config

PROMPTS = ["To be, or not to be", "x", "Now is the winter of our discontent", "O Romeo, Romeo!", "?"]
MAX_NUM_SEQS = 8


def static_llm(path, max_num_seqs: int = MAX_NUM_SEQS) -> tuple[LLM, DecodeGraphs]:
    """An LLM whose decode-only steps go through the static path, eagerly (capture=False)."""
    llm = LLM(path, max_num_seqs=max_num_seqs)
    runner = llm.engine.runner
    assert isinstance(runner, TorchRunner) and runner.cache is not None
    runner.decode_graphs = DecodeGraphs(runner.model, runner.cache, max_num_seqs, runner.device, capture=False)
    return llm, runner.decode_graphs


def count_static_steps(graphs: DecodeGraphs) -> list[int]:
    """Wraps execute to record the number of sequences of each step it served."""
    served: list[int] = []
    execute = graphs.execute

    def counting(output):
        served.append(len(output.scheduled))
        return execute(output)

    graphs.execute = counting  # type: ignore[method-assign]
    return served


@pytest.fixture(scope="module")
def artifact(tiny_model):
    return tiny_model(seed=5, num_layers=3, moe=moe_config(layers=(0, 2)))


def test_bucket_sizes() -> None:
    assert bucket_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert bucket_sizes(3) == (1, 2, 3)
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(12) == (1, 2, 4, 8, 12)


def mixed_params(seed: int = 0) -> list[SamplingParams]:
    """Greedy requests at every k and of different lengths, so the batch shrinks through the buckets."""
    return [
        SamplingParams(
            max_tokens=4 + 3 * i,
            temperature=0,
            experts_per_token=1 + (i + seed) % NUM_EXPERTS,
            logprobs=3,
            ignore_eos=True,
        )
        for i in range(len(PROMPTS))
    ]


def assert_same_outputs(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        out_x, out_y = x.outputs[0], y.outputs[0]
        assert out_x.token_ids == out_y.token_ids
        torch.testing.assert_close(torch.tensor(out_x.logprobs), torch.tensor(out_y.logprobs), atol=1e-5, rtol=0)
        for tops_x, tops_y in zip(out_x.top_logprobs, out_y.top_logprobs, strict=True):
            assert tops_x.keys() == tops_y.keys()


@pytest.mark.slow
def test_static_decode_equals_eager_with_mixed_k(artifact) -> None:
    eager = LLM(artifact, max_num_seqs=MAX_NUM_SEQS).generate(PROMPTS, mixed_params())
    llm, graphs = static_llm(artifact)
    served = count_static_steps(graphs)
    static = llm.generate(PROMPTS, mixed_params())
    assert_same_outputs(static, eager)
    # Decode steps of 5, 4, 3, 2 and 1 sequences: buckets 8, 4, 4, 2, 1, so padding rows were exercised.
    assert {5, 4, 3, 2, 1} <= set(served)


def test_static_decode_each_request_alone_equals_batched(artifact) -> None:
    llm, _ = static_llm(artifact)
    params = mixed_params(seed=1)
    batched = llm.generate(PROMPTS, params)
    for prompt, p, together in zip(PROMPTS, params, batched, strict=True):
        alone = llm.generate([prompt], p)
        assert_same_outputs(alone, [together])


def test_static_decode_top_p_policy_counts_the_experts_of_real_rows_only(artifact) -> None:
    policy = {"policy": "top_p", "p": 0.6, "min": 1, "max": NUM_EXPERTS}
    params = [
        SamplingParams(
            max_tokens=6,
            temperature=0,
            logprobs=2,
            ignore_eos=True,
            **({"moe": policy} if i % 2 else {"experts_per_token": 2}),
        )
        for i in range(3)
    ]
    eager = LLM(artifact, max_num_seqs=MAX_NUM_SEQS).generate(PROMPTS[:3], params)
    llm, graphs = static_llm(artifact)
    served = count_static_steps(graphs)
    static = llm.generate(PROMPTS[:3], params)
    assert served, "the decode steps took the static path"
    assert_same_outputs(static, eager)
    for a, b in zip(static, eager, strict=True):
        assert a.experts == b.experts  # padding rows (bucket 4 for 3) count none


def test_static_decode_expert_load_counts_no_padding(artifact) -> None:
    def load(llm: LLM) -> dict[int, list[int]]:
        llm.engine.runner.track_expert_load()
        llm.generate(PROMPTS[:3], SamplingParams(max_tokens=5, temperature=0, experts_per_token=2, ignore_eos=True))
        return llm.engine.runner.read_expert_load()

    eager = load(LLM(artifact, max_num_seqs=MAX_NUM_SEQS))
    llm, _ = static_llm(artifact)
    assert load(llm) == eager


def test_padding_rows_write_only_the_scratch_block(artifact) -> None:
    llm, graphs = static_llm(artifact)
    cache = graphs.cache
    keys = cache.layers[0][0]
    before = keys.clone()
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    used = {b for b in range(cache.shape.num_blocks) if not torch.equal(keys[b], before[b])}
    # Every block written belongs to a sequence (the block manager's) or is the scratch block.
    assert cache.scratch_block not in range(cache.shape.num_blocks)
    assert keys.shape[0] == cache.shape.num_blocks + 1
    assert used, "the sequences wrote their keys"
    assert not torch.equal(keys[cache.scratch_block], before[cache.scratch_block])


def test_staging_fields_do_not_overlap_and_block_tables_come_last(artifact) -> None:
    _, graphs = static_llm(artifact)
    staging = graphs.staging
    spans = sorted(
        (staging.offsets[name], staging.offsets[name] + view.numel() * view.element_size(), name)
        for name, view in staging.device_views.items()
    )
    for (_, end, _), (start, _, _) in zip(spans, spans[1:], strict=False):
        assert end <= start
    assert spans[-1][2] == "block_tables"
    assert all(start % 8 == 0 for start, _, _ in spans)


def test_unsupported_models_say_why() -> None:
    assert unsupported_reason(lm_config()) is None
    assert "relative" in (unsupported_reason(lm_config(position="relative")) or "")
    stateful = lm_config(moe=moe_config(router=router_config("similarity")))
    assert "state" in (unsupported_reason(stateful) or "")
    assert "encoder" in (unsupported_reason(classifier_config()) or "")


def test_no_graphs_on_cpu(artifact) -> None:
    """decode_graphs_for applies to CUDA only: CPU serving keeps the eager path."""
    runner = LLM(artifact).engine.runner
    assert isinstance(runner, TorchRunner) and runner.decode_graphs is None
