"""Top-p routing (a request's `moe` policy): each token's k from its router probabilities, against a slow
per-row reference (tests/reference_moe.py), at several p, with exact ties and p = 1; then the whole MoE
layer with top-p and fixed-k sequences in one batch, and the experts it counts per sequence."""

from __future__ import annotations

import math

import pytest
import torch

from moe_serve.kernels import ops
from moe_serve.layers.routers import RouterConfig, router_class, router_config
from tests.batches import KERNELS, pack, packed_batch, unpack, use_kernels
from tests.reference_moe import choose, reference_moe, top_p_k
from tests.unit.layers.test_moe_layer import EXPERTS, ROUTERS, batch, make_block, route

N = 8
P_VALUES = (0.3, 0.5, 0.8, 1.0)
# The kinds a top-p policy is defined for (each token's own router probabilities order its experts).
TOKEN_ROUTERS = {name: config for name, config in ROUTERS.items() if router_class(config.kind).top_p_defined}


@pytest.fixture(params=KERNELS, autouse=True)
def kernels(request, monkeypatch) -> str:
    use_kernels(monkeypatch, request.param)
    return request.param


def logits_with_ties() -> torch.Tensor:
    """Random rows, and rows whose probabilities tie exactly (equal logits: 1/8 each, so the running sums
    0.125, 0.25, ..., land exactly on p = 0.5 in fp32 as in float64)."""
    generator = torch.Generator().manual_seed(7)
    rows = [torch.randn(N, generator=generator) * scale for scale in (0.5, 1.0, 2.0, 4.0) for _ in range(6)]
    rows += [
        torch.zeros(N),  # all tied
        torch.tensor([2.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]),  # a tie at the top
        torch.tensor([0.0, 0.0, 0.0, 0.0, 3.0, 3.0, 3.0, 3.0]),  # tied top four at the high indices
        torch.tensor([5.0, -9.0, -9.0, -9.0, -9.0, -9.0, -9.0, -9.0]),  # one expert holds nearly all
    ]
    return torch.stack(rows)


def reference_route(logits: torch.Tensor, ks: list[int], config: RouterConfig) -> tuple[list[list[int]], list]:
    ids, weights = [], []
    kind = router_class(config.kind)(config, logits.shape[1])
    for row, k in zip(logits.tolist(), ks, strict=True):
        chosen = choose(row, k)
        ids.append(chosen)
        weights.append(kind.reference_weights(row, chosen))
    return ids, weights


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize(("min_k", "max_k"), [(1, N), (2, 5), (3, 3)])
@pytest.mark.parametrize("router", TOKEN_ROUTERS.values(), ids=TOKEN_ROUTERS.keys())
def test_top_p_cut_and_weights_match_the_reference(p: float, min_k: int, max_k: int, router: RouterConfig) -> None:
    logits = logits_with_ties()
    rows = logits.shape[0]
    expected_k = [top_p_k(row, p, min_k, max_k) for row in logits.tolist()]
    cut = torch.full((rows,), p if p < 1 else math.inf)
    k = ops.top_p_k(logits, cut, torch.full((rows,), min_k), torch.full((rows,), max_k), max_k)
    assert k.tolist() == expected_k
    assert k.dtype == torch.int64
    ids, weights = route(logits, k, max_k, router)
    expected_ids, expected_weights = reference_route(logits, expected_k, router)
    for r in range(rows):
        n = expected_k[r]
        assert ids[r, :n].tolist() == expected_ids[r]
        assert (ids[r, n:] == -1).all() and (weights[r, n:] == 0).all()  # never computed
        torch.testing.assert_close(weights[r, :n], torch.tensor(expected_weights[r]), atol=1e-6, rtol=1e-6)


def test_exact_ties_and_p_one() -> None:
    """The boundary cases by hand: a sum that reaches p exactly stops there; tied experts go to the lower
    index; p = 1 takes the max even where fp32 sums reach 1 early."""
    logits = logits_with_ties()[-4:]
    ks = lambda p, low=1, high=N: ops.top_p_k(  # noqa: E731
        logits, torch.full((4,), p), torch.full((4,), low), torch.full((4,), high), high
    ).tolist()
    # Row 0: 4 x 1/8 is exactly 0.5. Row 1: a tied pair of 0.356 each. Row 2: four ties of 0.238 each.
    assert ks(0.5) == [4, 2, 3, 1]
    assert ks(0.125) == [1, 1, 1, 1]
    assert ks(0.8) == [7, 4, 4, 1]
    assert ks(math.inf) == [N] * 4  # p = 1
    assert ks(0.5, low=2, high=3) == [3, 2, 3, 2]
    ids, _ = route(logits[1:3], torch.tensor([1, 3]), 3, router_config("topk_softmax"))
    assert ids.tolist() == [[0, -1, -1], [4, 5, 6]]  # of tied experts, the lower indices


def test_fixed_rows_keep_their_k() -> None:
    """A fixed-k token in a top-p batch (cut = inf, min = max = k) takes exactly k, whatever the others."""
    logits = logits_with_ties()
    rows = logits.shape[0]
    token_k = torch.arange(rows) % N + 1
    k = ops.top_p_k(logits, torch.full((rows,), math.inf), token_k, token_k, N)
    assert k.tolist() == token_k.tolist()


@pytest.mark.parametrize("router", TOKEN_ROUTERS.values(), ids=TOKEN_ROUTERS.keys())
def test_moe_layer_mixes_top_p_and_fixed_k_sequences(router: RouterConfig) -> None:
    block = make_block(router, EXPERTS["glu_silu"], seed=5)
    x, mask = batch(seed=6)
    lengths = mask.sum(1).tolist()
    ks = [4, 2, 6, 3]
    policies = [(0.5, 1), None, (0.8, 2), (1.0, 1)]
    taken: list[list[int]] = [[] for _ in ks]
    expected = reference_moe(block, x, mask, ks, policies, taken)
    forward = packed_batch(lengths, ks, policies)
    with torch.no_grad():
        out = unpack(block(pack(x, mask), forward, 0), mask)
    torch.testing.assert_close(out * mask[..., None], expected, atol=1e-5, rtol=1e-5)
    assert forward.adaptive_k is not None
    assert forward.adaptive_k.experts_used[0].tolist() == [sum(t) for t in taken]
    assert taken[1] == [2] * lengths[1] and taken[3] == [3] * lengths[3]  # fixed k; p = 1 takes the max
    assert len({k for t in taken[:1] + taken[2:3] for k in t}) > 1  # top-p gave tokens different k
