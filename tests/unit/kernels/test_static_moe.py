"""The static-shape MoE (moe_serve.kernels.static_moe): the alignment the CUDA kernels read, and its torch
twin moe_experts_blocked against reference.moe_experts_torch at every k, mixed k, rows with no slot, many experts,
GLU and MLP banks."""

from __future__ import annotations

import pytest
import torch

from moe_serve.kernels import reference
from moe_serve.kernels.static_moe import align, capacity, moe_experts_blocked
from moe_serve.kernels.vocabulary import ExpertWeights
from tests.host_reads import HostReads

K = 4
# Relative to the output's largest value. bf16: the blocked bmm and the grouped GEMM round at the same
# points; what differs is the GEMMs' accumulation order, within 2 bf16 ulps (seen: equal).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def routing(row_k: list[int], e: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, K], row t's first row_k[t] slots distinct experts, -1 beyond; fp32 weights, 0 beyond."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:K] for _ in row_k])
    used = torch.arange(K)[None, :] < torch.tensor(row_k)[:, None]
    return ids.masked_fill(~used, -1), torch.where(used, torch.rand(len(row_k), K, generator=g) + 0.1, 0.0)


@pytest.mark.parametrize("e,block_m", [(4, 4), (8, 16), (64, 16)])
def test_align_invariants(e: int, block_m: int) -> None:
    row_k = [2, 0, 4, 1, 3, 4, 4]
    ids, _ = routing(row_k, e, seed=e)
    alignment = align(ids, e, block_m)
    slots, blocks = alignment.sorted_slots, alignment.block_expert
    num_slots = ids.numel()
    assert slots.shape == (capacity(num_slots, e, block_m),) and blocks.shape == (slots.shape[0] // block_m,)
    flat = ids.reshape(-1)
    real = slots[slots < num_slots].long()
    # Every used slot exactly once, no unused one.
    assert sorted(real.tolist()) == torch.arange(num_slots)[flat >= 0].tolist()
    per_block = slots.reshape(-1, block_m)
    for b, expert in enumerate(blocks.tolist()):
        rows = per_block[b][per_block[b] < num_slots].long()
        if expert < 0:  # past the last group: padding only, and every later block too
            assert len(rows) == 0 and (blocks[b:] == -1).all()
            continue
        assert len(rows) > 0  # padding fills a group's last block only
        assert (flat[rows] == expert).all()
        assert torch.equal(rows, rows.sort().values)  # slot order within a group (stable)
        # Real rows first in a block, then padding.
        assert (per_block[b][: len(rows)] < num_slots).all()
    used_blocks = blocks[blocks >= 0]
    assert torch.equal(used_blocks, used_blocks.sort().values)  # groups in expert order, one run each
    counts = torch.bincount(flat[flat >= 0], minlength=e)
    assert torch.equal(torch.bincount(used_blocks.long(), minlength=e), (counts + block_m - 1) // block_m)


def test_align_shapes_follow_only_t_k_e_block_m() -> None:
    """The capacity is static: any routing of the same [T, K] gives the same shapes (nothing read on the host)."""
    t, e, block_m = 5, 8, 16
    routings = [
        torch.full((t, K), -1),
        torch.zeros(t, K, dtype=torch.int64),
        routing([4] * t, e, seed=0)[0],
        routing([1, 0, 3, 2, 4], e, seed=1)[0],
    ]
    shapes = {(a.sorted_slots.shape, a.block_expert.shape) for a in (align(ids, e, block_m) for ids in routings)}
    assert len(shapes) == 1
    nothing = align(routings[0], e, block_m)
    assert (nothing.sorted_slots == t * K).all() and (nothing.block_expert == -1).all()


def test_no_host_sync() -> None:
    ids, weights = routing([2, 0, 4], 8, seed=5)
    bank = make_bank(torch.float32, True, 8)
    x = torch.randn(3, 32)
    with HostReads() as reads:
        align(ids, 8, 16)
        moe_experts_blocked(x, ids, weights, bank)
    assert reads.seen == []
    with HostReads() as reads:  # the check itself sees them
        reference.moe_experts_torch(x, ids, weights, bank)
    assert reads.seen


def make_bank(dtype: torch.dtype, glu: bool, e: int, d: int = 32, i: int = 24) -> ExpertWeights:
    g = torch.Generator().manual_seed(e + glu)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    return ExpertWeights(
        w1=rand(e, i, d, scale=d**-0.5),
        w2=rand(e, d, i, scale=i**-0.5),
        activation="silu" if glu else "gelu",
        b1=rand(e, i),
        w3=rand(e, i, d, scale=d**-0.5) if glu else None,
        b3=rand(e, i) if glu else None,
        b2=rand(e, d),
    )


ROUTINGS = {f"k={k}": [k] * 3 for k in range(1, K + 1)} | {"mixed": [2, 0, 4, 1, 3], "none": [0, 0]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("glu", [False, True], ids=["mlp", "glu"])
@pytest.mark.parametrize("e", [8, 64])
@pytest.mark.parametrize("routing_name", ROUTINGS)
def test_blocked_matches_torch(dtype: torch.dtype, glu: bool, e: int, routing_name: str) -> None:
    row_k = ROUTINGS[routing_name]
    ids, weights = routing(row_k, e, seed=len(row_k))
    x = torch.randn(len(row_k), 32, generator=torch.Generator().manual_seed(7)).to(dtype)
    bank = make_bank(dtype, glu, e)
    out = moe_experts_blocked(x, ids, weights, bank)
    expected = reference.moe_experts_torch(x, ids, weights, bank)
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * scale)
    for row, k in enumerate(row_k):
        if k == 0:
            assert torch.equal(out[row], torch.zeros_like(out[row]))


def test_blocked_never_reads_unused_weights() -> None:
    """An unused slot adds nothing even when its weight is NaN (never 0 * garbage)."""
    ids, weights = routing([2, 0, 3], 8, seed=3)
    x = torch.randn(3, 32)
    bank = make_bank(torch.float32, True, 8)
    poisoned = torch.where(ids >= 0, weights, float("nan"))
    assert torch.equal(moe_experts_blocked(x, ids, poisoned, bank), moe_experts_blocked(x, ids, weights, bank))
