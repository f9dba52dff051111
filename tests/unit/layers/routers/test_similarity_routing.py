"""Similarity-aware (graph-of-tokens) routing, `similarity` (method card graph_routing.md §8): the runtime
against a reference that writes out the [T, T] matrix, the limit tau -> 0 (plain top-k), negative controls
that a wrong implementation would fail, and the engine: one prefill = chunked prefill = token-by-token
decode = a prefix-cache hit = recomputation after preemption, and batch invariance."""

from __future__ import annotations

import pytest
import torch

from moe_serve import LLM, EngineConfig
from moe_serve.errors import ConfigError
from moe_serve.layers.routers import router_config
from moe_serve.layers.routers.base import RouterState
from moe_serve.layers.routers.similarity import mix
from tests.batches import pack, packed_batch
from tests.conftest import lm_config, moe_config
from tests.reference_moe import similarity_mix
from tests.routing_checks import assert_alone_equals_batched, assert_every_cache_path_routes_alike
from tests.unit.layers.test_moe_layer import EXPERTS, make_block

LENGTHS = (6, 1, 9, 4)


def _inputs(seed: int = 0, unit: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(len(LENGTHS), max(LENGTHS), 16, generator=generator)
    if unit:  # equal norms: every token is most similar to itself
        x = x / x.norm(dim=-1, keepdim=True)
    mask = torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]
    return x, mask


def _runtime_mix(block, x: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """The runtime's q per sequence (the no-cache path: every sequence whole in one step)."""
    flat = pack(x, mask)
    batch = packed_batch(list(LENGTHS), [2] * len(LENGTHS))
    q = mix(block.router_logits(flat), RouterState(None, batch.attention, 0, flat), block.config.router.tau)
    return list(q.split(LENGTHS))


@pytest.mark.parametrize("tau", [0.25, 1.0, 4.0])
def test_the_mix_equals_the_written_out_matrix(tau: float) -> None:
    block = make_block(router_config("similarity", use_bias=True, tau=tau), EXPERTS["glu_silu"], seed=2)
    x, mask = _inputs(seed=3)
    for b, got in enumerate(_runtime_mix(block, x, mask)):
        want = similarity_mix(block, x[b, : LENGTHS[b]].double())
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)


def test_tau_to_zero_is_plain_top_k_routing() -> None:
    """With equal-norm inputs S -> I as tau -> 0, so q_i = p_i: the experts and weights of topk_softmax."""
    x, mask = _inputs(seed=5, unit=True)
    similar = make_block(router_config("similarity", tau=1e-4), EXPERTS["glu_silu"], seed=4)
    plain = make_block(router_config("topk_softmax"), EXPERTS["glu_silu"], seed=4)
    flat = pack(x, mask)
    for k in (1, 2, 4, 6):
        batch = packed_batch(list(LENGTHS), [k] * len(LENGTHS))
        with torch.no_grad():
            torch.testing.assert_close(similar(flat, batch, 0), plain(flat, batch, 0), atol=1e-6, rtol=0)


def test_negative_controls_change_routing() -> None:
    """What the reference tests would catch: a bidirectional graph, mixing logits instead of probabilities,
    and a graph across sequences each choose other experts for some tokens."""
    block = make_block(router_config("similarity", tau=4.0), EXPERTS["glu_silu"], seed=6)
    x, mask = _inputs(seed=7)
    runtime = _runtime_mix(block, x, mask)
    ids = [q.topk(2, dim=-1).indices for q in runtime]
    w = block.router.weight.double()

    def differs(alternative: list[torch.Tensor]) -> bool:
        return any(not torch.equal(a.topk(2, dim=-1).indices, b) for a, b in zip(alternative, ids, strict=True))

    seqs = [x[b, : LENGTHS[b]].double() for b in range(len(LENGTHS))]
    assert differs([similarity_mix(block, s, causal=False) for s in seqs])
    logit_mix = []
    for s in seqs:
        causal = torch.ones(len(s), len(s), dtype=torch.bool).triu(1)
        weights = torch.softmax((s @ s.T / 4.0).masked_fill(causal, float("-inf")), dim=-1)
        logit_mix.append(torch.softmax(weights @ (s @ w.T), dim=-1))
    assert differs(logit_mix)
    together = similarity_mix(block, torch.cat(seqs))  # one graph over the flattened batch
    assert differs(list(together.split(LENGTHS)))


def test_a_bad_tau_is_refused() -> None:
    with pytest.raises(ConfigError, match="router tau"):
        router_config("similarity", tau=0.0)


# ---- in the engine: the router state in the paged cache ------------------------------------------


def _llm(make_artifact, **engine) -> LLM:
    config = lm_config(num_layers=3, moe=moe_config(layers=(0, 2), router=router_config("similarity", tau=2.0)))
    return LLM(make_artifact(config, seed=17), EngineConfig(**engine))


def test_prefill_chunks_decode_prefix_hits_and_preemption_route_alike(make_artifact) -> None:
    assert_every_cache_path_routes_alike(lambda **engine: _llm(make_artifact, **engine))


def test_a_request_alone_equals_it_in_a_mixed_k_batch(make_artifact) -> None:
    assert_alone_equals_batched(_llm(make_artifact))


def test_k_other_than_the_trained_one_is_flagged_approximate(make_artifact) -> None:
    llm = _llm(make_artifact)
    assert llm.config.moe.experts_per_token.default == 2
    assert not llm.config.is_approximate(2) and llm.config.is_approximate(1) and llm.config.is_approximate(4)
