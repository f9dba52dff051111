"""The offline API: bad per-call input, sampling behaviour, classification and scoring."""

from __future__ import annotations

import math

import pytest
import torch

from moe_serve import LLM, EngineConfig, SamplingParams
from moe_serve.errors import ValidationError
from tests.conftest import NUM_EXPERTS, classifier_config, lm_config


@pytest.fixture(scope="module")
def llm(tiny_llm) -> LLM:
    return tiny_llm(seed=5)


BAD_CALLS = {
    "k zero": (lambda llm: llm.generate("hi", SamplingParams(experts_per_token=0)), "experts_per_token", "at least 1"),
    "k above N": (
        lambda llm: llm.generate("hi", SamplingParams(experts_per_token=NUM_EXPERTS + 1)),
        "experts_per_token",
        f"between 1 and {NUM_EXPERTS}, got 5",
    ),
    "k not an integer": (
        lambda llm: llm.generate("hi", SamplingParams(experts_per_token="two")),
        "experts_per_token",
        "must be an integer",
    ),
    "k float": (lambda llm: llm.score("hi there", experts_per_token=2.5), "experts_per_token", "must be an integer"),
    "empty prompt list": (lambda llm: llm.generate([]), "prompt", "non-empty list"),
    "empty prompt": (lambda llm: llm.generate([""]), "prompt", "must not be empty"),
    "max_tokens zero": (lambda llm: llm.generate("hi", SamplingParams(max_tokens=0)), "max_tokens", "at least 1"),
    "prompt too long": (
        lambda llm: llm.generate("x" * 300, SamplingParams(max_tokens=1)),
        "prompt",
        "context is 256 tokens",
    ),
    "prompt + max_tokens too long": (
        lambda llm: llm.generate("x" * 200, SamplingParams(max_tokens=100)),
        "max_tokens",
        "exceeds",
    ),
    "temperature negative": (
        lambda llm: llm.generate("hi", SamplingParams(temperature=-1)),
        "temperature",
        "between 0.0 and 100.0",
    ),
    "top_p above one": (lambda llm: llm.generate("hi", SamplingParams(top_p=1.5)), "top_p", "between 0.0 and 1.0"),
    "params count": (
        lambda llm: llm.generate(["a", "b"], [SamplingParams()]),
        "sampling_params",
        "1 SamplingParams for 2 prompts",
    ),
    "classify on an LM": (lambda llm: llm.classify("hi"), "model", "classify needs a sequence_classification model"),
    "token id out of range": (
        lambda llm: llm.generate([[1, 2, 999]]),
        "prompt",
        "token ids must be integers in 0..259",
    ),
}


@pytest.mark.parametrize("call,parameter,message", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_bad_input_names_the_parameter_and_engine_stays_usable(llm: LLM, call, parameter: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message) as info:
        call(llm)
    assert info.value.parameter == parameter
    assert isinstance(info.value, ValueError)
    assert not llm.engine.has_unfinished()
    out = llm.generate("still alive", SamplingParams(max_tokens=3, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 3


def test_same_seed_same_text_and_different_seed_differs(llm: LLM) -> None:
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True) for s in (7, 7, 8)]
    a, b, c = (llm.generate("Once more unto the breach", p)[0].outputs[0] for p in params)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.token_ids != c.token_ids


def test_temperature_zero_is_greedy_argmax(llm: LLM) -> None:
    prompt = llm.tokenizer.encode("What's in a name?")
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, experts_per_token=3))[0]
    tokens = list(prompt)
    runner, model = llm.engine.runner, llm.artifact.model
    for token in out.outputs[0].token_ids:  # recompute each step from scratch, no cache
        with torch.inference_mode():
            hidden, _ = runner.forward_padded([tokens], [3])
            assert int(model.lm_logits(hidden)[0, -1].argmax()) == token
        tokens.append(token)


def test_top_k_one_equals_greedy(llm: LLM) -> None:
    greedy = llm.generate("Lord, what fools", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    top1 = llm.generate(
        "Lord, what fools", SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=3, ignore_eos=True)
    )
    assert greedy[0].outputs[0].token_ids == top1[0].outputs[0].token_ids


def test_stop_string_cuts_the_output(llm: LLM) -> None:
    free = llm.generate("The lady doth protest", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[
        0
    ].outputs[0]
    stop = free.text[5:7]
    assert len(stop) == 2
    cut = llm.generate(
        "The lady doth protest", SamplingParams(max_tokens=30, temperature=0, stop=[stop], ignore_eos=True)
    )[0].outputs[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)]
    assert stop not in cut.text
    assert free.finish_reason == "length" and len(free.token_ids) == 30


def test_n_completions_and_logprobs(llm: LLM) -> None:
    out = llm.generate(
        "Et tu", SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=1, logprobs=2, ignore_eos=True)
    )[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    for o in out.outputs:
        assert len(o.logprobs) == 5 and all(lp <= 0 for lp in o.logprobs)
        assert all(len(t) == 2 for t in o.top_logprobs)


def test_score_reports_logprob_tokens_and_bits_per_byte(llm: LLM) -> None:
    text = "Exit, pursued by a bear."
    scored = llm.score([text, "Ay"], experts_per_token=[1, NUM_EXPERTS], return_token_logprobs=True)
    first = scored[0]
    assert first.num_tokens == len(text.encode()) and first.num_bytes == len(text.encode())
    assert first.total_logprob == pytest.approx(sum(first.token_logprobs), rel=1e-6)
    assert first.bits_per_byte == pytest.approx(-first.total_logprob / math.log(2) / first.num_bytes)
    assert [s.experts_per_token for s in scored] == [1, NUM_EXPERTS]
    # Scoring a text alone or in a batch gives the same numbers.
    alone = llm.score(text, experts_per_token=1)[0]
    assert alone.total_logprob == pytest.approx(first.total_logprob, abs=1e-4)


def test_classifier_with_soft_merge(make_artifact) -> None:
    llm = LLM(make_artifact(classifier_config(), seed=2))
    texts = ["My kingdom for a horse!", "If music be the food of love, play on", "Out, damned spot!"]
    full = llm.classify(texts)
    assert [c.experts_per_token for c in full] == [NUM_EXPERTS] * 3
    assert not any(c.approximate for c in full)
    for c in full:
        assert set(c.probs) == {"comedy", "history", "tragedy"}
        assert sum(c.probs.values()) == pytest.approx(1.0)
        assert c.label == max(c.probs, key=c.probs.get)
    merged_top1 = llm.classify(texts, experts_per_token=1)
    assert all(c.approximate for c in merged_top1)
    # Alone vs batched with other k: identical probabilities.
    alone = llm.classify(texts[1], experts_per_token=2)[0]
    mixed = llm.classify(texts, experts_per_token=[4, 2, 1])[1]
    for label in alone.probs:
        assert mixed.probs[label] == pytest.approx(alone.probs[label], abs=1e-6)
    with pytest.raises(ValidationError, match="generate needs a causal_lm model"):
        llm.generate("x")


def test_kv_budget_refuses_what_can_never_fit_and_queues_the_rest(make_artifact) -> None:
    from moe_serve import EngineConfig

    llm = LLM(make_artifact(), EngineConfig(kv_cache_tokens=40, max_num_seqs=8))
    with pytest.raises(ValidationError, match="needs 45 tokens of KV cache .* budget is 40; it can never run") as info:
        llm.generate([[1] * 5], SamplingParams(max_tokens=40))
    assert info.value.parameter == "max_tokens"
    # Four requests of 20 tokens each: at most two run at once, all complete.
    outs = llm.generate(
        [[1] * 5, [2] * 5, [3] * 5, [4] * 5], SamplingParams(max_tokens=15, temperature=0, ignore_eos=True)
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [15] * 4


@pytest.mark.parametrize("budget", [1, 3])
def test_a_step_budget_under_the_calibration_prompts_still_serves(make_artifact, budget: int) -> None:
    """The start-up cost calibration times a prompt of an eighth of the step budget: at most 7 tokens a step,
    that was a prompt of none, and the engine did not start."""
    artifact = make_artifact(lm_config(), seed=3)
    want = LLM(artifact).generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, temperature=0))
    got = LLM(artifact, EngineConfig(max_num_batched_tokens=budget)).generate(
        [[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, temperature=0)
    )
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_a_score_input_the_cache_can_never_hold_is_refused_by_name(make_artifact) -> None:
    """Generation requests were checked against the KV capacity, score inputs were not: one longer than the cache
    waited forever at the head of the queue, and every request behind it with it."""
    llm = LLM(make_artifact(lm_config(), seed=3), EngineConfig(block_size=16, kv_cache_tokens=64))
    with pytest.raises(ValidationError, match="input has 121 tokens.*one sequence holds at most 64 tokens"):
        llm.score(["x" * 120])
    assert llm.score(["x" * 40])[0].num_tokens == 40  # and what fits is scored
