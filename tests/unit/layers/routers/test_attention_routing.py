"""Attention-aware (graph-of-tokens, A2) routing, `attention` (method card graph_routing.md §8): the
runtime against Lemma 1 written out (the head's attention times a Gaussian likelihood, renormalised), the
limit sigma -> inf (the head's own attention), negative controls, and the engine: one prefill = chunked
prefill = token-by-token decode = a prefix-cache hit = recomputation after preemption, batch invariance,
for rotary and Transformer-XL relative positions."""

from __future__ import annotations

import pytest
import torch

from moe_serve import LLM, EngineConfig
from moe_serve.errors import ConfigError
from moe_serve.layers.routers import router_config
from moe_serve.layers.routers.attention_aware import mix
from moe_serve.layers.routers.attention_aware import reference_mix as attention_aware_mix
from moe_serve.layers.routers.base import RouterState
from moe_serve.testing import create_random_artifact
from tests.batches import packed_batch
from tests.conftest import lm_config, moe_config
from tests.routing_checks import assert_alone_equals_batched, assert_every_cache_path_routes_alike

LENGTHS = (7, 1, 10, 4)
POSITIONS = {
    "rotary": {},
    "relative": {"norm_position": "post", "norm": "layernorm"},  # the Transformer-XL demos' backbone
}


def _config(position: str, sigma: float = 2.0, heads: tuple[int, ...] = (1, 3)):
    router = router_config("attention", heads=heads, sigma=sigma)
    return lm_config(
        num_layers=3, position=position, moe=moe_config(layers=(0, 2), router=router), **POSITIONS[position]
    )


def _layer_inputs(tmp_path, position: str, sigma: float):
    """A model's layer 2 on a packed batch without a cache: its attention inputs, an MoE input and the
    router logits, as the MoE block would see them."""
    llm = LLM(create_random_artifact(tmp_path / position, _config(position, sigma), seed=5))
    layer = llm.artifact.model.layers[2]
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(sum(LENGTHS), 32, generator=generator)
    batch = packed_batch(list(LENGTHS), [2] * len(LENGTHS))
    with torch.no_grad():
        _, attention = layer.attn.forward_with_inputs(x, batch, 2)
        moe_input = torch.randn(sum(LENGTHS), 32, generator=generator)
        logits = layer.moe.router_logits(moe_input)
    return layer, batch, attention, moe_input, logits


def _reference(
    attention, moe_input, logits, head: int, sigma: float, causal: bool = True, one_hot: bool = False, lengths=LENGTHS
) -> list[torch.Tensor]:
    """Lemma 1 per sequence; one_hot: the posterior attention itself (the mix of one-hot distributions)."""
    group = head // (attention.q.shape[1] // attention.k.shape[1])
    dh = attention.q.shape[2]
    w_o = attention.o_weight[:, head * dh : (head + 1) * dh]
    probs = torch.softmax(logits.double(), dim=-1)
    out, start = [], 0
    for n in lengths:
        rows = slice(start, start + n)
        positional = None
        if attention.relative is not None:
            rel = attention.relative
            positional = torch.tensor(
                [
                    [float(rel.q_rel[start + i, head] @ rel.r_k[max(i - j, 0) + rel.offset, head]) for j in range(n)]
                    for i in range(n)
                ]
            )
        q, k, v = attention.q[rows, head], attention.k[rows, group], attention.v[rows, group]
        p = torch.eye(n, dtype=torch.float64) if one_hot else probs[rows]
        out.append(attention_aware_mix(q, k, v, positional, attention.scale, w_o, moe_input[rows], p, sigma, causal))
        start += n
    return out


@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize("sigma", [0.5, 2.0])
def test_the_mix_equals_lemma_1_written_out(tmp_path, position: str, sigma: float) -> None:
    _, batch, attention, moe_input, logits = _layer_inputs(tmp_path, position, sigma)
    for head in (0, 3):
        state = RouterState(None, batch.attention, 0, moe_input, attention, 1)
        got = mix(logits, state, head, sigma).split(LENGTHS)
        for a, b in zip(got, _reference(attention, moe_input, logits, head, sigma), strict=True):
            torch.testing.assert_close(a.double(), b, atol=1e-6, rtol=0)


def test_sigma_to_infinity_is_the_heads_own_attention(tmp_path) -> None:
    _, batch, attention, moe_input, logits = _layer_inputs(tmp_path, "rotary", 2.0)
    state = RouterState(None, batch.attention, 0, moe_input, attention, 1)
    got = mix(logits, state, 2, 1e6).split(LENGTHS)
    probs, start = torch.softmax(logits.double(), dim=-1), 0
    for n, q in zip(LENGTHS, got, strict=True):
        rows = slice(start, start + n)
        scores = attention.q[rows, 2].double() @ attention.k[rows, 1].double().T * attention.scale
        own = torch.softmax(scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")), dim=-1)
        torch.testing.assert_close(q.double(), own @ probs[rows], atol=1e-6, rtol=0)
        start += n


def test_negative_controls_change_routing(tmp_path) -> None:
    """Bidirectional attention, mixing logits instead of probabilities, and one graph across the sequences
    of the batch each choose other experts for some tokens: the reference tests would catch them."""
    _, batch, attention, moe_input, logits = _layer_inputs(tmp_path, "rotary", 2.0)
    state = RouterState(None, batch.attention, 0, moe_input, attention, 1)
    ids = [q.topk(2, dim=-1).indices for q in mix(logits, state, 1, 2.0).split(LENGTHS)]

    def differs(alternative: list[torch.Tensor]) -> bool:
        return any(not torch.equal(a.topk(2, dim=-1).indices, b) for a, b in zip(alternative, ids, strict=True))

    assert not differs(_reference(attention, moe_input, logits, 1, 2.0))  # the comparison itself
    assert differs(_reference(attention, moe_input, logits, 1, 2.0, causal=False))
    # The posterior A^ itself (the reference mixing one-hot distributions), then applied to logits.
    posteriors = _reference(attention, moe_input, logits, 1, 2.0, one_hot=True)
    parts = logits.double().split(LENGTHS)
    assert differs([torch.softmax(a @ part, -1) for a, part in zip(posteriors, parts, strict=True)])
    across = _reference(attention, moe_input, logits, 1, 2.0, lengths=(sum(LENGTHS),))[0]  # one graph for all
    assert differs(list(across.split(LENGTHS)))


def test_heads_must_name_one_head_per_moe_layer() -> None:
    with pytest.raises(ConfigError, match="router kind attention needs router.heads"):
        _config("rotary", heads=(1,))
    with pytest.raises(ConfigError, match="router kind attention needs router.heads"):
        _config("rotary", heads=(1, 4))  # 4 heads: 0..3


# ---- in the engine ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("position", list(POSITIONS))
def test_prefill_chunks_decode_prefix_hits_and_preemption_route_alike(make_artifact, position: str) -> None:
    artifact = make_artifact(_config(position), seed=19)
    assert_every_cache_path_routes_alike(lambda **engine: LLM(artifact, EngineConfig(**engine)))


def test_a_request_alone_equals_it_in_a_mixed_k_batch(make_artifact) -> None:
    assert_alone_equals_batched(LLM(make_artifact(_config("relative"), seed=23)))
