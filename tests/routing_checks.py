"""Checks shared by the stateful routers' tests (graph-of-tokens routing keeps per-token state in the paged
cache): how a sequence was cut into steps, a prefix-cache hit, preemption or the batch must not change what
it computes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from moe_serve import LLM, SamplingParams
from moe_serve.engine.sequence import Sequence, SequenceKind

TEXT = "Is this a dagger which I see before me, the handle toward my hand? Come, let me clutch thee."


def spy_preemptions(llm: LLM) -> list[Sequence]:
    """The sequences the engine's scheduler preempts from now on."""
    preempted: list[Sequence] = []
    preempt = llm.engine.scheduler._preempt
    llm.engine.scheduler._preempt = lambda seq, out: (preempted.append(seq), preempt(seq, out))
    return preempted


def assert_every_cache_path_routes_alike(make_llm: Callable[..., LLM]) -> None:
    """One prefill = chunked prefill = token-by-token decode = a prefix-cache hit = recomputation after
    preemption. make_llm(**engine_config) builds the model's LLM."""
    whole = make_llm().score(TEXT, return_token_logprobs=True)[0].token_logprobs
    chunked = make_llm(max_num_batched_tokens=16).score(TEXT, return_token_logprobs=True)[0].token_logprobs
    torch.testing.assert_close(torch.tensor(chunked), torch.tensor(whole), atol=1e-5, rtol=0)

    llm = make_llm()
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=1, ignore_eos=True, experts_per_token=2)
    first = llm.generate(TEXT, params)[0].outputs[0]
    ids = llm.inputs.encode_text(TEXT, "prompt") + first.token_ids  # token by token, then scored at once
    (seq,) = llm.engine.add_inputs("rescore", [ids], 2, SequenceKind.SCORE)
    while llm.engine.has_unfinished():
        llm.engine.step()
    decoded = torch.tensor(first.logprobs)
    torch.testing.assert_close(torch.tensor(seq.prompt_logprobs[-12:]), decoded, atol=1e-5, rtol=0)
    hits = llm.engine.blocks.stats.hit_tokens  # the full blocks' keys, values and router state are cached
    again = llm.generate(TEXT, params)[0].outputs[0]
    assert llm.engine.blocks.stats.hit_tokens > hits and again.token_ids == first.token_ids
    torch.testing.assert_close(torch.tensor(again.logprobs), decoded, atol=1e-5, rtol=0)
    tight = make_llm(kv_cache_tokens=208, enable_prefix_caching=False)  # too small for 4 at once
    preempted = spy_preemptions(tight)
    outs = tight.generate([TEXT] * 4, params)
    assert preempted
    for out in outs:
        assert out.outputs[0].token_ids == first.token_ids


def assert_alone_equals_batched(llm: LLM) -> None:
    """A request alone and in a batch of others at other k: bitwise the same (each sequence's graph is
    computed on its own)."""
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=1, ignore_eos=True, experts_per_token=3)
    alone = llm.generate(TEXT, params)[0].outputs[0]
    others = ["Out, damned spot!", "To be, or not to be", "x", "Now is the winter of our discontent"]
    batch = llm.generate(
        others + [TEXT], [SamplingParams(max_tokens=6, experts_per_token=k) for k in (1, 4, 2, 1)] + [params]
    )[-1].outputs[0]
    assert batch.token_ids == alone.token_ids
    assert batch.logprobs == alone.logprobs
