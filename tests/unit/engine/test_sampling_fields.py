"""The OpenAI and vLLM sampling fields moe-serve implements, each with its effect observed: logit_bias,
presence/frequency/repetition penalties, min_p, min_tokens, stop_token_ids, include_stop_str_in_output,
skip_special_tokens. Fields it does not implement are refused (tests/server/test_openai_compat.py)."""

from __future__ import annotations

import pytest
import torch

from moe_serve import LLM, SamplingParams
from moe_serve.engine.sampler import sample
from moe_serve.engine.sequence import Sequence
from moe_serve.errors import ValidationError
from moe_serve.kernels import ops

EOS = 256
GREEDY = {"temperature": 0.0, "max_tokens": 8}


@pytest.fixture(scope="module")
def llm(tiny_llm) -> LLM:
    return tiny_llm(seed=3)


def seq(prompt: list[int], output: list[int], **params) -> Sequence:
    s = Sequence("r", 0, [*prompt, *output], len(prompt), 1, params=SamplingParams(**params))
    if not s.params.is_greedy:
        s.generator = torch.Generator().manual_seed(0)
    return s


def pick(logits: list[float], s: Sequence) -> int:
    """The token the engine samples: with each row's argmax given, as LLMEngine passes it (ops.greedy_rows)."""
    rows = torch.tensor([logits])
    return sample(rows, [s], (EOS,), ops.greedy_rows(rows)[0]).token_ids[0]  # type: ignore[return-value]


def test_a_given_argmax_is_what_plain_greedy_rows_take_and_adjusted_rows_recompute() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.5, 0.0]] * 3)
    given = torch.tensor([3, 3, 3])  # not the argmax: which rows read it shows
    rows = [seq([0], [], temperature=0.0), seq([0], [], temperature=0.0), seq([0], [], temperature=0.9, seed=1)]
    assert sample(logits, rows, (EOS,), given).token_ids[:2] == [3, 3]  # plain greedy rows keep it
    biased = [rows[0], seq([0], [], temperature=0.0, logit_bias={"2": 0.6}), rows[2]]
    assert sample(logits, biased, (EOS,), given).token_ids[:2] == [1, 2]  # a row adjusts: all recomputed


def test_logit_bias_moves_the_greedy_choice() -> None:
    logits = [0.0, 1.0, 0.5, 0.0]
    assert pick(logits, seq([0], [], temperature=0.0)) == 1
    assert pick(logits, seq([0], [], temperature=0.0, logit_bias={"2": 0.6})) == 2  # JSON's string keys


@pytest.mark.parametrize(
    "params,output,expected",
    [
        ({}, [1], 1),
        ({"presence_penalty": 1.5}, [1], 2),  # 3.0 - 1.5 < 2.0
        ({"frequency_penalty": 0.6}, [1], 1),  # once: 3.0 - 0.6 > 2.0
        ({"frequency_penalty": 0.6}, [1, 1], 2),  # twice: 3.0 - 1.2 < 2.0
        ({"repetition_penalty": 2.0}, [1], 2),  # 3.0 / 2 < 2.0
        ({"repetition_penalty": 2.0}, [], 1),  # token 1 not seen yet
    ],
    ids=["none", "presence", "frequency once", "frequency twice", "repetition", "repetition unseen"],
)
def test_penalties(params: dict, output: list[int], expected: int) -> None:
    assert pick([0.0, 3.0, 2.0, 0.0], seq([0], output, temperature=0.0, **params)) == expected


def test_repetition_penalty_counts_prompt_tokens_and_multiplies_negative_logits() -> None:
    assert pick([0.0, 3.0, 2.0, -5.0], seq([1], [], temperature=0.0, repetition_penalty=2.0)) == 2
    assert pick([-1.0, -0.6, -5.0, -5.0], seq([1], [], temperature=0.0, repetition_penalty=2.0)) == 0  # -1.2 < -1


def test_min_tokens_holds_eos_and_stop_token_ids_back() -> None:
    logits = [0.0] * 260
    logits[EOS], logits[7], logits[9] = 5.0, 4.0, 1.0
    assert pick(logits, seq([0], [1], temperature=0.0, min_tokens=3)) == 7
    assert pick(logits, seq([0], [1], temperature=0.0, min_tokens=3, stop_token_ids=[7])) == 9
    assert pick(logits, seq([0], [1, 2], temperature=0.0, min_tokens=2)) == EOS  # reached


def test_min_p_keeps_only_tokens_near_the_most_likely() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.1])).tolist()
    generator = torch.Generator().manual_seed(0)

    def draws(min_p: float, times: int) -> set[int]:
        found = set()
        for _ in range(times):
            s = seq([0], [], temperature=1.0, min_p=min_p)
            s.generator = generator
            found.add(pick(logits, s))
        return found

    assert draws(0.5, 200) == {0, 1}  # 0.1 < 0.5 * 0.5
    assert draws(0.0, 400) == {0, 1, 2, 3}


def test_stop_token_ids_end_generation(llm: LLM) -> None:
    full = llm.generate([[5, 6, 7]], SamplingParams(**GREEDY, ignore_eos=True))[0].outputs[0]
    stop = full.token_ids[3]
    cut = llm.generate([[5, 6, 7]], SamplingParams(**GREEDY, ignore_eos=True, stop_token_ids=[stop]))[0].outputs[0]
    first = full.token_ids.index(stop)
    assert cut.token_ids == full.token_ids[:first] and cut.finish_reason == "stop"


def test_min_tokens_with_a_forced_eos(llm: LLM) -> None:
    eos_first = SamplingParams(**GREEDY, logit_bias={EOS: 100.0})
    assert llm.generate([[5, 6]], eos_first)[0].outputs[0].token_ids == []
    held = SamplingParams(**GREEDY, logit_bias={EOS: 100.0}, min_tokens=3)
    out = llm.generate([[5, 6]], held)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "stop"


def test_include_stop_str_in_output(llm: LLM) -> None:
    text = llm.generate([[5, 6, 7]], SamplingParams(**{**GREEDY, "max_tokens": 24}, ignore_eos=True))[0].outputs[0].text
    stop = text[4:6]
    assert len(stop) == 2
    params = {**GREEDY, "max_tokens": 24, "ignore_eos": True, "stop": [stop]}
    cut = llm.generate([[5, 6, 7]], SamplingParams(**params))[0].outputs[0].text
    kept = llm.generate([[5, 6, 7]], SamplingParams(**params, include_stop_str_in_output=True))[0].outputs[0].text
    assert cut == text[: text.index(stop)] and kept == cut + stop


def test_skip_special_tokens_false_shows_them(llm: LLM) -> None:
    params = {**GREEDY, "max_tokens": 2, "ignore_eos": True, "logit_bias": {EOS: 100.0}}
    hidden = llm.generate([[5, 6]], SamplingParams(**params))[0].outputs[0]
    shown = llm.generate([[5, 6]], SamplingParams(**params, skip_special_tokens=False))[0].outputs[0]
    special = llm.engine.tokenizer.id_to_token(EOS)
    assert hidden.token_ids == shown.token_ids == [EOS, EOS]
    assert hidden.text == "" and shown.text == special * 2


@pytest.mark.parametrize(
    "fields,parameter",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 9}, "min_tokens"),  # more than max_tokens
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_out_of_range_values_name_the_field(fields: dict, parameter: str) -> None:
    with pytest.raises(ValidationError) as caught:
        SamplingParams(**GREEDY, **fields)
    assert caught.value.parameter == parameter


def test_token_ids_outside_the_vocabulary_are_refused(llm: LLM) -> None:
    for name, value in (("logit_bias", {999: 1.0}), ("stop_token_ids", [999])):
        with pytest.raises(ValidationError) as caught:
            llm.generate([[5]], SamplingParams(**GREEDY, **{name: value}))
        assert caught.value.parameter == name
