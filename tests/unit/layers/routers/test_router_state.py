"""A router kind with per-token state kept in the paged KV cache (the mechanism graph-of-tokens routing
needs), proven with a test kind: each token routes by the mean of the router probabilities of every token
of its sequence so far. Its results must not depend on how the sequence was cut into steps (one prefill,
chunks, token-by-token decode), on a prefix-cache hit, or on the batch."""

from __future__ import annotations

import pytest
import torch

from moe_serve import LLM, EngineConfig, SamplingParams
from moe_serve.engine.sequence import SequenceKind
from moe_serve.kernels import reference
from moe_serve.kernels.vocabulary import Weighting
from moe_serve.layers.routers import Router, RouterState, register, router_config
from tests.conftest import lm_config, moe_config

TEXT = "Is this a dagger which I see before me, the handle toward my hand?"


class _CausalMean(Router):
    reads_cache = True

    @classmethod
    def state_size(cls, num_experts: int, hidden_size: int) -> int:
        return num_experts

    def route(self, logits, token_k, max_k, state: RouterState | None = None):
        assert state is not None
        probs = torch.softmax(logits, dim=-1)  # [T, N]
        batch = state.batch
        state.cache[batch.slot_mapping] = probs  # this step's tokens, before anyone reads them
        mixed = torch.empty_like(probs)
        for t in range(probs.shape[0]):
            seq, position = int(batch.seq_ids[t]), int(batch.positions[t])
            if self.reads_cache:
                mixed[t] = state.cache[state.rows_of(seq, position + 1)].mean(0)
            else:  # the bug the test must catch: only the tokens of this step
                mine = (batch.seq_ids[: t + 1] == seq).nonzero()[:, 0]
                mixed[t] = probs[mine].mean(0)
        return reference.topk_route_torch(mixed.log(), token_k, max_k, Weighting.SOFTMAX_CHOSEN)


@register("test_causal_mean")
class CausalMean(_CausalMean):
    pass


@register("test_causal_mean_step_only")
class StepOnly(_CausalMean):
    reads_cache = False


def make(make_artifact, kind: str, **engine) -> LLM:
    config = lm_config(num_layers=3, moe=moe_config(layers=(0, 2), router=router_config(kind)))
    return LLM(make_artifact(config, seed=13), EngineConfig(**engine))


@pytest.mark.slow
def test_state_follows_chunks_decode_prefix_hits_and_batches(make_artifact) -> None:
    whole = make(make_artifact, "test_causal_mean").score(TEXT, return_token_logprobs=True)[0].token_logprobs
    chunked_llm = make(make_artifact, "test_causal_mean", max_num_batched_tokens=16)
    chunked = chunked_llm.score(TEXT, return_token_logprobs=True)[0].token_logprobs
    torch.testing.assert_close(torch.tensor(chunked), torch.tensor(whole), atol=1e-5, rtol=0)

    llm = make(make_artifact, "test_causal_mean")
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=1, ignore_eos=True, experts_per_token=2)
    first = llm.generate(TEXT, params)[0]
    # Token-by-token decode equals one prefill of the same tokens (scored; scoring never uses the cache).
    ids = llm.inputs.encode_text(TEXT, "prompt") + first.outputs[0].token_ids
    (seq,) = llm.engine.add_inputs("rescore", [ids], 2, SequenceKind.SCORE)
    while llm.engine.has_unfinished():
        llm.engine.step()
    torch.testing.assert_close(
        torch.tensor(seq.prompt_logprobs[-10:]), torch.tensor(first.outputs[0].logprobs), atol=1e-5, rtol=0
    )
    assert llm.engine.blocks.stats.hit_tokens == 0
    # The same prompt again: its full blocks (keys, values and router state) come from the prefix cache.
    again = llm.generate(TEXT, params)[0]
    assert llm.engine.blocks.stats.hit_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    torch.testing.assert_close(
        torch.tensor(again.outputs[0].logprobs), torch.tensor(first.outputs[0].logprobs), atol=1e-5, rtol=0
    )
    # And inside a batch of other prompts at other k.
    others = ["Out, damned spot!", "To be, or not to be", "x"]
    batch = llm.generate(
        others + [TEXT], [SamplingParams(max_tokens=5, experts_per_token=k) for k in (1, 3, 4)] + [params]
    )
    assert batch[-1].outputs[0].token_ids == first.outputs[0].token_ids


def test_a_router_that_ignores_the_cached_state_is_caught(make_artifact) -> None:
    """The negative control: without the cached state, chunked prefill no longer equals one prefill."""
    whole = make(make_artifact, "test_causal_mean_step_only").score(TEXT, return_token_logprobs=True)[0].token_logprobs
    chunked = make(make_artifact, "test_causal_mean_step_only", max_num_batched_tokens=16)
    values = chunked.score(TEXT, return_token_logprobs=True)[0].token_logprobs
    assert max(abs(a - b) for a, b in zip(values, whole, strict=True)) > 1e-3


@pytest.fixture(autouse=True, scope="module")
def _unregister():
    yield
    from moe_serve import router_registry

    for kind in ("test_causal_mean", "test_causal_mean_step_only"):
        router_registry._REGISTRY.pop(kind, None)
