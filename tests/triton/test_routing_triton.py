"""The routing kernels (moe_serve.kernels.cuda.routing) under Triton's interpreter, on CPU tensors: the top-k
against reference.topk_route_torch (ids equal; weights to fp32 rounding) for every weighting, each k from 0 to max k
in one batch, ties, -inf and NaN logits, a row alone equal to it in a batch; the alignment equal, integer for
integer, to static_moe.align over random routings with unused slots, block sizes and expert counts."""

from __future__ import annotations

import pytest
import torch

from moe_serve.kernels import reference, static_moe
from moe_serve.kernels.cuda import routing
from moe_serve.kernels.vocabulary import Weighting

pytestmark = pytest.mark.triton_interp


def logits_batch(rows: int, experts: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, experts, generator=g)
    logits[0] = 0.5  # every expert tied: the lowest indices win
    logits[1, ::2] = logits[1, 1]  # ties among some
    logits[2, : experts // 2] = float("-inf")  # the top half only is finite
    return logits


@pytest.mark.parametrize("weighting", list(Weighting))
@pytest.mark.parametrize(("experts", "max_k"), [(8, 2), (8, 8), (6, 3), (16, 5)])
def test_topk_route_equals_the_torch_route(weighting, experts, max_k) -> None:
    rows = 2 * (max_k + 1) + 3
    logits = logits_batch(rows, experts, seed=experts * 10 + max_k)
    token_k = torch.arange(rows) % (max_k + 1)  # every k from 0 (a graph's padding row) to max k
    token_k[:3] = max_k
    ids, weights = routing.topk_route(logits, token_k, max_k, weighting)
    want_ids, want_weights = reference.topk_route_torch(logits, token_k, max_k, weighting)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=1e-7)
    assert torch.equal(weights == 0, want_weights == 0)  # exactly zero beyond each row's k


def test_topk_route_puts_nan_first_as_the_stable_sort() -> None:
    logits = torch.tensor([[0.1, float("nan"), 0.3, float("nan"), 0.2]])
    ids, _ = routing.topk_route(logits, torch.tensor([3]), 3, Weighting.UNIFORM)
    want, _ = reference.topk_route_torch(logits, torch.tensor([3]), 3, Weighting.UNIFORM)
    assert ids.tolist() == want.tolist() == [[1, 3, 2]]


def test_topk_route_row_alone_equals_the_row_in_a_batch() -> None:
    logits = logits_batch(9, 8, seed=3)
    token_k = torch.tensor([2, 1, 2, 0, 2, 1, 2, 2, 1])
    softmax = Weighting.SOFTMAX_CHOSEN
    ids, weights = routing.topk_route(logits, token_k, 2, softmax)
    for r in (3, 4, 8):
        alone_ids, alone_weights = routing.topk_route(logits[r : r + 1], token_k[r : r + 1], 2, softmax)
        assert torch.equal(alone_ids[0], ids[r]) and torch.equal(alone_weights[0], weights[r])


@pytest.mark.parametrize(
    ("tokens", "max_k", "experts", "block_m"),
    [(1, 2, 8, 64), (3, 2, 8, 16), (16, 2, 8, 64), (7, 8, 8, 16), (33, 4, 16, 16), (64, 8, 128, 16), (5, 1, 3, 16)],
)
def test_align_equals_the_torch_alignment(tokens, max_k, experts, block_m) -> None:
    g = torch.Generator().manual_seed(tokens * 100 + experts)
    for _ in range(3):
        ids = torch.stack([torch.randperm(experts, generator=g)[:max_k] for _ in range(tokens)])
        unused = torch.rand(tokens, max_k, generator=g) < 0.3  # rows with k below max k; some with no expert
        ids = ids.masked_fill(unused, -1)
        got = routing.align(ids, experts, block_m)
        want = static_moe.align(ids, experts, block_m)
        assert torch.equal(got.sorted_slots, want.sorted_slots)
        assert torch.equal(got.block_expert, want.block_expert)


def test_align_past_its_limit_is_the_torch_alignment(monkeypatch) -> None:
    monkeypatch.setattr(routing, "ALIGN_MAX_SLOTS", 8)
    ids = torch.tensor([[1, 0], [1, -1], [2, 1], [0, 1], [2, -1]])  # 10 slots
    got = routing.align(ids, 4, 16)
    want = static_moe.align(ids, 4, 16)
    assert torch.equal(got.sorted_slots, want.sorted_slots) and torch.equal(got.block_expert, want.block_expert)
