"""A failure tied to one sequence finishes that sequence with an error; the step goes on for the others."""

from __future__ import annotations

import pytest

from moe_serve import LLM, EngineConfig, SamplingParams
from moe_serve.engine.model_runner import TorchRunner


@pytest.fixture(scope="module")
def llm(tiny_llm) -> LLM:
    return tiny_llm(seed=9)


def run(llm: LLM, prompts: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    engine = llm.engine
    seqs = {
        name: engine.add_request(name, engine.inputs.generation_request(ids, params))[0]
        for name, (ids, params) in prompts.items()
    }
    while engine.has_unfinished():
        engine.step()
    for name in prompts:
        engine.release(name)
    return seqs


def test_unsampleable_settings_fail_only_their_sequence(llm: LLM) -> None:
    good = SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True)
    bad = SamplingParams(max_tokens=6, temperature=0.8, ignore_eos=True)
    bad.top_k = 2**63  # past verify() (the HTTP edge refuses it): no int64 holds it, so sampling it fails
    seqs = run(
        llm,
        {
            "good": ([1, 2, 3], good),
            "bad": ([4, 5, 6], bad),
            "greedy": ([7, 8], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)),
        },
    )
    assert seqs["bad"].finish_reason == "error" and isinstance(seqs["bad"].error, Exception)
    assert seqs["good"].finish_reason == "length" and seqs["good"].num_output_tokens == 6
    assert seqs["greedy"].finish_reason == "length" and seqs["greedy"].num_output_tokens == 6
    alone = run(llm, {"good": ([1, 2, 3], good)})["good"]
    assert alone.output_token_ids == seqs["good"].output_token_ids


def test_a_forward_that_fails_for_one_sequence_fails_only_it(llm: LLM, monkeypatch) -> None:
    original = TorchRunner.execute

    def fails_on_poison(self, output):
        if any(item.seq.request_id == "poison" for item in output.scheduled):
            raise RuntimeError("this input breaks the model")
        return original(self, output)

    monkeypatch.setattr(TorchRunner, "execute", fails_on_poison)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    seqs = run(llm, {"a": ([1, 2], params), "poison": ([3, 4], params), "b": ([5, 6, 7], params)})
    assert seqs["poison"].finish_reason == "error" and "breaks the model" in str(seqs["poison"].error)
    assert [seqs[n].num_output_tokens for n in ("a", "b")] == [4, 4]
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_used_blocks == 0


def test_a_failed_step_publishes_none_of_its_blocks_to_the_prefix_cache(tiny_model, monkeypatch) -> None:
    """A sequence whose step failed may have left its blocks unwritten (here: holding another request's keys):
    the same prompt sent again must find none of them in the prefix cache, and generates what it generates in
    an engine without a prefix cache."""
    artifact = tiny_model(seed=9)
    llm = LLM(artifact, EngineConfig(block_size=16))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = list(range(10, 50))  # two full blocks of 16, and more
    llm.generate([[200 + i % 50 for i in range(64)]], params)  # its freed blocks are the next ones taken
    original = TorchRunner.execute

    def fails(self, output):
        raise RuntimeError("failed before writing its keys")

    monkeypatch.setattr(TorchRunner, "execute", fails)
    assert run(llm, {"broken": (prompt, params)})["broken"].finish_reason == "error"
    monkeypatch.setattr(TorchRunner, "execute", original)
    hits = llm.engine.blocks.stats.hit_tokens
    again = run(llm, {"again": (prompt, params)})["again"].output_token_ids
    assert llm.engine.blocks.stats.hit_tokens == hits  # nothing found: the failed step published nothing
    alone = LLM(artifact, EngineConfig(block_size=16, enable_prefix_caching=False)).generate([prompt], params)
    assert again == alone[0].outputs[0].token_ids
