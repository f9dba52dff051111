"""Constrained decoding in the engine: each structured-output kind holds its constraint, composes with a row's
own k, sampling, n, logprobs, stop strings and max_tokens, and a constrained row batched with free rows gets
bitwise what it gets alone. The model is random (its text is noise), so what passes is the grammar's doing."""

from __future__ import annotations

import json
import re

import pytest
import torch

from moe_serve import LLM, EngineConfig, SamplingParams
from moe_serve.engine.grammar import token_bitmask
from moe_serve.errors import ValidationError
from moe_serve.kernels import ops
from moe_serve.structured_output import MAX_SPEC_CHARS, StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["merry", "sad"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "mood", "tags"],
    "additionalProperties": False,
}
JSON = StructuredOutput.json_schema(SCHEMA, "response_format")


@pytest.fixture(scope="module")
def llm(tiny_llm) -> LLM:
    return tiny_llm(seed=31, engine=EngineConfig(max_num_seqs=8))


def valid(text: str) -> dict:
    value = json.loads(text)
    assert list(value) == ["name", "age", "mood", "tags"]  # the schema's order
    assert len(value["name"]) <= 6 and 0 <= value["age"] <= 120 and value["mood"] in ("merry", "sad")
    assert len(value["tags"]) <= 3 and all(isinstance(t, bool) for t in value["tags"])
    return value


@pytest.mark.parametrize("k", [1, 2])
def test_json_schema_holds_at_every_k_greedy_and_sampled(llm: LLM, k: int) -> None:
    greedy = SamplingParams(max_tokens=120, temperature=0, experts_per_token=k, structured_output=JSON)
    sampled = SamplingParams(max_tokens=120, temperature=1.0, seed=7, n=3, experts_per_token=k, structured_output=JSON)
    for out in llm.generate(["Hello", "To be"], greedy) + llm.generate(["Hi"], sampled):
        for completion in out.outputs:
            assert completion.finish_reason == "stop"  # the grammar ended it, not max_tokens
            valid(completion.text)


def test_json_schema_holds_under_a_moe_policy(llm: LLM) -> None:
    from moe_serve.moe_policy import MoEPolicy

    params = SamplingParams(max_tokens=120, temperature=0, moe=MoEPolicy("top_p", 0.5), structured_output=JSON)
    out = llm.generate("Hello", params)[0]
    assert out.outputs[0].finish_reason == "stop"
    valid(out.outputs[0].text)


def test_json_object_regex_choice_and_grammar(llm: LLM) -> None:
    cases = [
        (StructuredOutput.json_object("response_format"), lambda t: isinstance(json.loads(t), dict)),
        (
            StructuredOutput.regex(r"[A-Z][a-z]{2,5} \d{2}", "guided_regex"),
            re.compile(r"[A-Z][a-z]{2,5} \d{2}").fullmatch,
        ),
        (
            StructuredOutput.choice(["yes", "no", "perchance"], "guided_choice"),
            lambda t: t in ("yes", "no", "perchance"),
        ),
        (
            StructuredOutput.grammar('root ::= "my " ("lord" | "lady")', "guided_grammar"),
            lambda t: t in ("my lord", "my lady"),
        ),
        (StructuredOutput.grammar('start: "a" | "b" "c"', "guided_grammar"), lambda t: t in ("a", "bc")),  # Lark
    ]
    for output, holds in cases:
        params = SamplingParams(max_tokens=200, temperature=0.8, seed=3, n=2, structured_output=output)
        for completion in llm.generate("Hello", params)[0].outputs:
            if output.kind == "json_object" and completion.finish_reason == "length":
                continue  # any object may be longer than max_tokens
            assert completion.finish_reason == "stop" and holds(completion.text), (output, completion.text)


def test_a_constrained_row_batched_with_free_rows_equals_it_alone(llm: LLM) -> None:
    """Bitwise: tokens and logprobs of each row alone, and all four rows in one batch at two k."""
    rows = [
        (
            "Hello",
            SamplingParams(max_tokens=40, temperature=0, experts_per_token=1, structured_output=JSON, logprobs=2),
        ),
        ("Hello", SamplingParams(max_tokens=40, temperature=0, experts_per_token=2, logprobs=2)),
        ("To be", SamplingParams(max_tokens=40, temperature=0.9, seed=5, experts_per_token=2, structured_output=JSON)),
        ("To be", SamplingParams(max_tokens=40, temperature=0.9, seed=5, experts_per_token=1)),
    ]
    together = llm.generate([p for p, _ in rows], [params for _, params in rows])
    for (prompt, params), batched in zip(rows, together, strict=True):
        alone = llm.generate(prompt, params)[0].outputs[0]
        assert batched.outputs[0].token_ids == alone.token_ids
        assert batched.outputs[0].logprobs == alone.logprobs
    assert together[0].outputs[0].token_ids != together[1].outputs[0].token_ids  # the grammar changed row 0


def test_stop_strings_and_max_tokens_still_end_a_constrained_row(llm: LLM) -> None:
    free_text = StructuredOutput.regex(r"[a-z]{30}", "guided_regex")
    cut = llm.generate("Hi", SamplingParams(max_tokens=5, temperature=0, structured_output=free_text))[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5
    full = llm.generate("Hi", SamplingParams(max_tokens=40, temperature=0, structured_output=free_text))[0].outputs[0]
    stop = full.text[3:5]
    stopped = llm.generate("Hi", SamplingParams(max_tokens=40, temperature=0, stop=[stop], structured_output=free_text))
    assert (
        stopped[0].outputs[0].finish_reason == "stop"
        and stopped[0].outputs[0].text == full.text[: full.text.index(stop)]
    )


def allowed_ids(matcher, width: int) -> list[int]:
    logits = torch.zeros(1, width)
    ops.mask_logits(logits, torch.tensor([0]), token_bitmask([matcher], width))
    return logits[0].isfinite().nonzero().flatten().tolist()


def test_masks_allow_only_the_grammars_tokens_and_eos_at_the_end(llm: LLM) -> None:
    grammars = llm.engine.inputs.grammars
    matcher = grammars.compile(StructuredOutput.choice(["ab"], "guided_choice")).matcher()
    width = grammars.vocab_size  # 260: past the byte tokenizer's 257, never allowed
    assert allowed_ids(matcher, width) == [ord("a")]
    assert matcher.consume(ord("a")) and not matcher.is_stopped
    assert matcher.consume(ord("b")) and matcher.is_stopped
    assert allowed_ids(matcher, width) == [llm.engine.inputs.config.eos_token_ids[0]]


def test_compiled_grammars_are_cached_by_what_they_depend_on(llm: LLM) -> None:
    grammars = llm.engine.inputs.grammars
    first = grammars.compile(StructuredOutput.json_schema(SCHEMA, "response_format"))
    assert grammars.compile(StructuredOutput.json_schema(json.dumps(SCHEMA), "guided_json")) is first
    reordered = {**SCHEMA, "properties": dict(reversed(SCHEMA["properties"].items()))}
    assert grammars.compile(StructuredOutput.json_schema(reordered, "response_format")) is not first  # order matters


@pytest.mark.parametrize(
    ("output", "message"),
    [
        (lambda: StructuredOutput.regex("((", "guided_regex"), "unclosed group"),
        (lambda: StructuredOutput.json_schema({"type": "string", "pattern": "(("}, "response_format"), "unclosed"),
        (lambda: StructuredOutput.json_schema({"type": "frobnicate"}, "response_format"), "frobnicate"),
        (lambda: StructuredOutput.grammar("root ::= (", "guided_grammar"), "cannot be compiled"),
    ],
)
def test_what_the_library_refuses_is_an_error_naming_the_field(llm: LLM, output, message: str) -> None:
    structured = output()
    with pytest.raises(ValidationError, match=message) as caught:
        llm.generate("Hi", SamplingParams(structured_output=structured))
    assert caught.value.parameter == structured.parameter


def test_bad_specs_and_settings_that_overrule_the_grammar_are_refused() -> None:
    with pytest.raises(ValidationError, match="at most") as caught:
        StructuredOutput.regex("a" * (MAX_SPEC_CHARS + 1), "guided_regex")
    assert caught.value.parameter == "guided_regex"
    deep: dict = {"type": "integer"}
    for _ in range(2000):  # deeper than Python's recursion: refused before anything recurses over it
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ValidationError, match="more than 128 deep"):
        StructuredOutput.json_schema(deep, "response_format")
    with pytest.raises(ValidationError, match="not valid JSON"):
        StructuredOutput.json_schema("{nope", "guided_json")
    with pytest.raises(ValidationError, match="non-empty strings"):
        StructuredOutput.choice([], "guided_choice")
    for setting in ({"ignore_eos": True}, {"min_tokens": 2}):
        with pytest.raises(ValidationError, match="the grammar decides where the output ends") as caught:
            SamplingParams(structured_output=JSON, **setting)
        assert caught.value.parameter == next(iter(setting))


def test_objects_are_closed_to_undeclared_keys_unless_the_schema_opens_them(llm: LLM) -> None:
    """JSON Schema admits any further key by default; a model given that freedom writes keys until max_tokens.
    As OpenAI's strict mode: only the declared properties, unless additionalProperties says otherwise."""
    nested = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"enum": [1]}}}}}
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=1, n=4)
    closed = StructuredOutput.json_schema(nested, "guided_json")
    for completion in llm.generate("Hi", SamplingParams(**{**_fields(params), "structured_output": closed}))[0].outputs:
        assert completion.finish_reason == "stop" and set(json.loads(completion.text)) <= {"a"}
    grammars = llm.engine.inputs.grammars
    opened = {**nested, "additionalProperties": True}
    matcher = grammars.compile(StructuredOutput.json_schema(opened, "guided_json")).matcher()
    for token in b'{"zz":':  # an undeclared key: allowed only where the schema opens the object
        assert matcher.consume(token)
    matcher = grammars.compile(closed).matcher()
    assert matcher.consume(ord("{")) and matcher.consume(ord('"')) and not matcher.consume(ord("z"))


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in ("max_tokens", "temperature", "seed", "n")}


def test_preemption_and_prefix_caching_keep_a_constrained_rows_result(tiny_llm, monkeypatch) -> None:
    """Rows preempted (recomputed from their tokens, the matcher where it was) and rows whose prompt comes
    from the prefix cache generate what they generate with room to spare."""
    from moe_serve.engine.scheduler import Scheduler

    roomy = tiny_llm(seed=31, engine=EngineConfig(max_num_seqs=8))
    tight = tiny_llm(seed=31, engine=EngineConfig(max_num_seqs=8, block_size=16, kv_cache_tokens=192))
    preempted = []
    original = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, seq, out: (preempted.append(seq), original(self, seq, out)))
    prompt = "To be, or not to be: that is the question"  # shared by every row: its blocks are cached
    params = [
        SamplingParams(
            max_tokens=100, temperature=0.9, seed=s, structured_output=JSON if s % 2 else None, ignore_eos=not s % 2
        )
        for s in range(4)
    ]
    want = roomy.generate([prompt] * 4, params)
    got = tight.generate([prompt] * 4, params)
    assert preempted, "the tight cache preempted nothing: the test tests nothing"
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert any(seq.num_cached_tokens for seq in preempted)  # readmitted from the prefix cache
    for o in got[1::2]:
        assert o.outputs[0].finish_reason == "stop"
        valid(o.outputs[0].text)


def test_the_engine_thread_imports_nothing_heavy_for_a_mask(tiny_model) -> None:
    """llguidance.torch wraps a function in torch.compile at import: its import took 0.8 s of the first
    constrained step. The masks are written through the matcher directly; the module is never imported."""
    import subprocess
    import sys

    script = (
        "import sys; from moe_serve import LLM, SamplingParams; "
        "from moe_serve.structured_output import StructuredOutput as S; "
        f"llm = LLM({str(tiny_model())!r}); "
        "out = llm.generate('Hi', SamplingParams(max_tokens=8, structured_output=S.choice(['ab'], 'c'))); "
        "assert out[0].outputs[0].text == 'ab', out; "
        "print(sorted(m for m in sys.modules if m.startswith('llguidance')))"
    )
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert "llguidance" in loaded and "llguidance.torch" not in loaded
