"""A request's result does not depend on what it is batched with (docs/architecture.md §3)."""

from __future__ import annotations

import pytest
import torch

from moe_serve import LLM, SamplingParams
from tests.conftest import NUM_EXPERTS, moe_config

OTHER_PROMPTS = [
    "To be, or not to be",
    "x",
    "Now is the winter of our discontent made glorious summer",
    "O Romeo, Romeo!",
    "All the world's a stage, and all the men and women merely players",
    "?",
    "Friends, Romans, countrymen, lend me your ears",
]
TARGET = "Good night, good night! parting is such sweet sorrow"


@pytest.fixture(scope="module")
def llm(tiny_llm) -> LLM:
    """Three layers with MoE in layers 0 and 2, so k acts twice per token."""
    return tiny_llm(seed=11, num_layers=3, moe=moe_config(layers=(0, 2)))


@pytest.mark.parametrize("k", range(1, NUM_EXPERTS + 1))
def test_greedy_tokens_and_logprobs_alone_vs_in_a_mixed_batch(llm: LLM, k: int) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, experts_per_token=k, logprobs=5, ignore_eos=True)
    alone = llm.generate([TARGET], params)[0].outputs[0]
    others = [
        SamplingParams(
            max_tokens=3 + i, temperature=0 if i % 2 else 0.9, seed=i, experts_per_token=1 + (i + k) % NUM_EXPERTS
        )
        for i in range(len(OTHER_PROMPTS))
    ]
    position = k % (len(OTHER_PROMPTS) + 1)
    prompts = OTHER_PROMPTS[:position] + [TARGET] + OTHER_PROMPTS[position:]
    all_params = others[:position] + [params] + others[position:]
    assert len(prompts) == 8
    batched = llm.generate(prompts, all_params)[position].outputs[0]
    assert batched.token_ids == alone.token_ids
    torch.testing.assert_close(torch.tensor(batched.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
    for a, b in zip(alone.top_logprobs, batched.top_logprobs, strict=True):
        assert a.keys() == b.keys()
        torch.testing.assert_close(torch.tensor(list(b.values())), torch.tensor(list(a.values())), atol=1e-5, rtol=0)


def test_full_logits_alone_vs_padded_batch_with_other_k(llm: LLM) -> None:
    tokenizer, runner, model = llm.tokenizer, llm.engine.runner, llm.artifact.model
    target = tokenizer.encode(TARGET)
    with torch.inference_mode():
        hidden, _ = runner.forward_padded([target], [3])
        alone = model.lm_logits(hidden)[0]
        batch = [tokenizer.encode(p) for p in OTHER_PROMPTS]
        hidden, _ = runner.forward_padded(batch[:4] + [target] + batch[4:], [1, 4, 2, 1, 3, 4, 2, 1])
        together = model.lm_logits(hidden)[4, : len(target)]
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


def test_seeded_sampling_alone_vs_in_batch(llm: LLM) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, experts_per_token=2)
    alone = llm.generate([TARGET], params)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=5, temperature=0.7, experts_per_token=4) for _ in OTHER_PROMPTS]
    batched = llm.generate(OTHER_PROMPTS + [TARGET], others + [params])[-1].outputs[0].token_ids
    assert batched == alone


POLICIES = [
    {"policy": "top_p", "p": 0.5, "min": 1, "max": NUM_EXPERTS},
    {"policy": "top_p", "p": 0.8, "min": 2, "max": 3},
    {"policy": "top_p", "p": 1.0},
]


@pytest.mark.parametrize("policy", POLICIES, ids=["p0.5", "p0.8-min2-max3", "p1"])
def test_top_p_request_alone_vs_with_fixed_k_and_other_policies(llm: LLM, policy: dict) -> None:
    """A `moe` policy's tokens each take their own k; its tokens and logprobs are those it gets alone (within
    1e-5, the contract of docs/architecture.md §3: a fixed k is not bitwise here either), whatever fixed-k
    requests and other policies share its batches."""
    params = SamplingParams(max_tokens=12, temperature=0, moe=policy, logprobs=5, ignore_eos=True)
    alone = llm.generate([TARGET], params)[0]
    others = [
        SamplingParams(
            max_tokens=3 + i,
            temperature=0 if i % 2 else 0.9,
            seed=i,
            **({"experts_per_token": 1 + i % NUM_EXPERTS} if i % 3 else {"moe": POLICIES[i // 3]}),
        )
        for i in range(len(OTHER_PROMPTS))
    ]
    batched = llm.generate(OTHER_PROMPTS[:3] + [TARGET] + OTHER_PROMPTS[3:], others[:3] + [params] + others[3:])[3]
    assert batched.outputs[0].token_ids == alone.outputs[0].token_ids
    torch.testing.assert_close(
        torch.tensor(batched.outputs[0].logprobs), torch.tensor(alone.outputs[0].logprobs), atol=1e-5, rtol=0
    )
    for a, b in zip(alone.outputs[0].top_logprobs, batched.outputs[0].top_logprobs, strict=True):
        assert a.keys() == b.keys()
        torch.testing.assert_close(torch.tensor(list(b.values())), torch.tensor(list(a.values())), atol=1e-5, rtol=0)
    assert alone.experts_per_token is None and alone.experts is not None
    low, high = policy.get("min", 1), policy.get("max", NUM_EXPERTS)
    assert low <= alone.experts.mean <= high  # type: ignore[operator]
    if policy["p"] == 1.0:
        assert alone.experts.mean == high


def test_top_p_changes_k_per_token(llm: LLM) -> None:
    """The test above could pass with the policy ignored: here it must have cut some tokens short and not
    others (a mean strictly between min and max), and the result differs from every fixed k."""
    params = SamplingParams(max_tokens=8, temperature=0, moe=POLICIES[0], logprobs=0, ignore_eos=True)
    out = llm.generate([TARGET], params)[0]
    assert 1 < out.experts.mean < NUM_EXPERTS  # type: ignore[union-attr,operator]
    per_layer = out.experts.layer_means()  # type: ignore[union-attr]
    assert set(per_layer) == {0, 2}
    assert any(mean != round(mean) for mean in per_layer.values())  # tokens of one layer took different k
    fixed = [
        llm.generate([TARGET], SamplingParams(max_tokens=8, temperature=0, experts_per_token=k, logprobs=0))[0]
        for k in range(1, NUM_EXPERTS + 1)
    ]
    assert all(f.outputs[0].logprobs != out.outputs[0].logprobs for f in fixed)


def test_top_p_score_alone_vs_in_batch(llm: LLM) -> None:
    """Scoring computes every token (no prefix-cache shortcut), so even the expert counts must match."""
    policy = POLICIES[1]
    alone = llm.score(TARGET, moe=policy, return_token_logprobs=True)[0]
    together = llm.score(OTHER_PROMPTS + [TARGET], moe=policy, return_token_logprobs=True)[-1]
    torch.testing.assert_close(
        torch.tensor(together.token_logprobs), torch.tensor(alone.token_logprobs), atol=1e-5, rtol=0
    )
    assert together.experts == alone.experts  # every token took the same k in every layer
    fixed = llm.score(OTHER_PROMPTS + [TARGET], experts_per_token=[1, 2, 3, 4, 1, 2, 3, 4], return_token_logprobs=True)
    assert fixed[-1].experts.mean == 4  # type: ignore[union-attr]
