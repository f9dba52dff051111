"""A request's `moe` policy in the Python API: checked with errors naming `moe.<field>`, resolved against the
model (its k range, its router kind), taken by generate, classify and score, and reported as the mean k."""

from __future__ import annotations

import pytest

from moe_serve import LLM, SamplingParams
from moe_serve.errors import ValidationError
from moe_serve.layers.routers import router_config
from moe_serve.moe_policy import KSpec, MoEPolicy
from tests.conftest import NUM_EXPERTS, classifier_config, lm_config, moe_config

TEXT = "Now is the winter of our discontent"


@pytest.fixture(scope="module")
def llm(tiny_llm) -> LLM:
    return tiny_llm(seed=3)


BAD_POLICIES = {
    "p zero": ({"policy": "top_p", "p": 0}, "moe.p", "greater than 0"),
    "p above one": ({"policy": "top_p", "p": 1.5}, "moe.p", "between 0.0 and 1.0"),
    "p negative": ({"policy": "top_p", "p": -0.1}, "moe.p", "between 0.0 and 1.0"),
    "p not a number": ({"policy": "top_p", "p": "high"}, "moe.p", "must be a number"),
    "p missing": ({"policy": "top_p"}, "moe.p", "required"),
    "min above max": ({"policy": "top_p", "p": 0.5, "min": 3, "max": 2}, "moe.min", "greater than moe.max"),
    "min zero": ({"policy": "top_p", "p": 0.5, "min": 0}, "moe.min", "at least 1"),
    "max not an integer": ({"policy": "top_p", "p": 0.5, "max": 2.5}, "moe.max", "must be an integer"),
    "unknown policy": ({"policy": "entropy", "p": 0.5}, "moe.policy", "must be one of top_p"),
    "policy missing": ({"p": 0.5}, "moe.policy", "required"),
    "unknown field": ({"policy": "top_p", "p": 0.5, "k": 2}, "moe.k", "no field"),
}


@pytest.mark.parametrize(("policy", "parameter", "message"), BAD_POLICIES.values(), ids=BAD_POLICIES.keys())
def test_bad_policies_name_the_field(policy: dict, parameter: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message) as info:
        SamplingParams(moe=policy)
    assert info.value.parameter == parameter


def test_policy_against_the_model(llm: LLM) -> None:
    def error(call) -> ValidationError:
        with pytest.raises(ValidationError) as info:
            call()
        return info.value

    too_many = error(lambda: llm.generate("hi", SamplingParams(moe={"policy": "top_p", "p": 0.5, "max": 5})))
    assert too_many.parameter == "moe.max" and f"between 1 and {NUM_EXPERTS}" in str(too_many)
    both = error(lambda: llm.score(TEXT, experts_per_token=2, moe={"policy": "top_p", "p": 0.5}))
    assert both.parameter == "moe" and "not both" in str(both)
    assert error(lambda: SamplingParams(experts_per_token=2, moe=MoEPolicy(p=0.5))).parameter == "moe"
    # Defaults: the model's whole k range.
    assert llm.inputs.resolve(None, MoEPolicy(p=0.7)) == KSpec(NUM_EXPERTS, 0.7, 1)
    assert llm.inputs.resolve(3, None) == KSpec(3)


def test_refused_where_top_p_is_undefined(make_artifact) -> None:
    smear = LLM(make_artifact(classifier_config(), seed=1))  # soft_merge: one merged expert per input
    with pytest.raises(ValidationError, match="router kind soft_merge") as info:
        smear.classify(TEXT, moe={"policy": "top_p", "p": 0.5})
    assert info.value.parameter == "moe.policy"
    dense = LLM(make_artifact(lm_config(moe=None, ffn=lm_config().ffn), seed=1))
    with pytest.raises(ValidationError, match="no MoE layers") as info:
        dense.generate("hi", SamplingParams(moe={"policy": "top_p", "p": 0.5}))
    assert info.value.parameter == "moe"


def test_generate_score_and_classify_take_a_policy(llm: LLM, make_artifact) -> None:
    policy = {"policy": "top_p", "p": 0.6, "min": 1, "max": 3}
    out = llm.generate(TEXT, SamplingParams(max_tokens=6, temperature=0, moe=policy, ignore_eos=True))[0]
    assert out.experts_per_token is None and out.experts is not None
    assert 1 <= out.experts.mean <= 3  # type: ignore[operator]
    # Prompt tokens and the generated tokens fed back (not the last one), in the one MoE layer.
    assert out.experts.tokens == len(out.prompt_token_ids) + 5 and [l for l, _ in out.experts.per_layer] == [1]
    fixed = llm.generate(TEXT, SamplingParams(max_tokens=6, temperature=0, experts_per_token=2))[0]
    assert fixed.experts_per_token == 2 and fixed.experts.mean == 2  # type: ignore[union-attr]

    scored = llm.score([TEXT, "Ay"], moe=MoEPolicy(p=0.6, max=3))
    assert all(s.experts_per_token is None and 1 <= s.experts.mean <= 3 for s in scored)  # type: ignore[union-attr,operator]

    config = classifier_config(moe=moe_config(router=router_config("topk_uniform")))
    classifier = LLM(make_artifact(config, seed=2))
    (label,) = classifier.classify(TEXT, moe=policy)
    assert label.experts_per_token is None and 1 <= label.experts.mean <= 3  # type: ignore[union-attr,operator]
    assert label.approximate is False


def test_approximate_under_a_policy() -> None:
    """A policy is flagged when any k its tokens may take is one the method is not exact at."""
    config = classifier_config()  # soft_merge: exact at k = N only
    assert config.is_approximate(KSpec(NUM_EXPERTS, 0.5, NUM_EXPERTS)) is False
    assert config.is_approximate(KSpec(NUM_EXPERTS, 0.5, NUM_EXPERTS - 1)) is True
    assert config.reported_k(KSpec(3, 0.5, 1)) is None and config.reported_k(KSpec(3)) == 3
