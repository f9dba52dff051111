"""The MoE Triton kernels (moe_serve.kernels.cuda.moe) under Triton's interpreter, on CPU tensors, against
reference.moe_experts_torch: every activation, GLU or not, biases or not, each k, mixed k, a row with no slot,
and a row's result alone equal to its result in a batch. Tiny shapes: each program costs the interpreter
10-40 ms. The kernels' INTERPRET flag (set by the interpreter) gives the dots fp32 operands and rounds
bf16 results to nearest even, as the GPU does."""

from __future__ import annotations

import pytest
import torch

from moe_serve.kernels import reference
from moe_serve.kernels.cuda import moe as triton_moe
from moe_serve.kernels.vocabulary import ExpertWeights

pytestmark = pytest.mark.triton_interp


K = 4
# Tolerances against moe_experts_torch, relative to the output's largest value (worst seen over 3 seeds x 4
# banks in brackets): fp32 differs by summation order only [4e-7]; 16-bit by the rounding points, since
# the kernel keeps fp32 from the dot through the biases and the activation where the torch path rounds
# after each op [fp16 1.3e-3, bf16 6.5e-3, about 2 bf16 ulps; the kernel is the closer of the two to fp64].
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1.6e-2}


def make_bank(
    dtype: torch.dtype, activation: str, glu: bool, biases: bool, d: int = 48, i: int = 40, e: int = 8
) -> ExpertWeights:
    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape) * scale).to(dtype)

    return ExpertWeights(
        w1=rand(e, i, d, scale=d**-0.5),
        w2=rand(e, d, i, scale=i**-0.5),
        activation=activation,
        b1=rand(e, i) if biases else None,
        w3=rand(e, i, d, scale=d**-0.5) if glu else None,
        b3=rand(e, i) if biases and glu else None,
        b2=rand(e, d) if biases else None,
    )


def routing(row_k: list[int], e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, K] with row t's first row_k[t] slots distinct experts and -1 beyond; fp32 weights, 0 beyond."""
    ids = torch.stack([torch.randperm(e)[:K] for _ in row_k])
    used = torch.arange(K)[None, :] < torch.tensor(row_k)[:, None]
    weights = torch.where(used, torch.rand(len(row_k), K) + 0.1, 0.0)
    return ids.masked_fill(~used, -1), weights


def check(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, bank: ExpertWeights) -> torch.Tensor:
    out = triton_moe.moe_experts(x, ids, weights, bank)
    expected = reference.moe_experts_torch(x, ids, weights, bank)
    assert out.dtype == x.dtype and out.shape == x.shape
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), rtol=TOLERANCE[x.dtype], atol=TOLERANCE[x.dtype] * scale)
    return out


# Each activation once with GLU and once without, biases on and off across them.
BANKS = [("relu", False, True), ("gelu", True, True), ("gelu_tanh", False, False), ("silu", True, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation,glu,biases", BANKS)
def test_matches_torch_with_mixed_k(dtype: torch.dtype, activation: str, glu: bool, biases: bool) -> None:
    torch.manual_seed(0)
    bank = make_bank(dtype, activation, glu, biases)
    row_k = [2, 0, 4, 1, 3, 4]  # every k of 0..K in one batch; row 1 has no slot
    ids, weights = routing(row_k, 8)
    out = check(torch.randn(len(row_k), 48).to(dtype), ids, weights, bank)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # exactly 0, not a rounding of it


@pytest.mark.parametrize("k", range(1, K + 1))
def test_each_k(k: int) -> None:
    torch.manual_seed(k)
    ids, weights = routing([k] * 3, 8)
    check(torch.randn(3, 48), ids, weights, make_bank(torch.float32, "silu", True, True))


def test_many_experts() -> None:
    """E = 64: blocks of 16 rows (tiling's many-experts case), most of the 60-odd blocks idle."""
    torch.manual_seed(1)
    ids, weights = routing([4, 2], 64)
    check(torch.randn(2, 32), ids, weights, make_bank(torch.float32, "gelu", True, True, d=32, i=64, e=64))


def test_no_slot_used_gives_zero() -> None:
    """Rows with every slot -1 give exactly 0; their weights (NaN here) are never read."""
    torch.manual_seed(2)
    ids = torch.full((3, K), -1)
    out = triton_moe.moe_experts(
        torch.randn(3, 48), ids, torch.full((3, K), float("nan")), make_bank(torch.float32, "relu", False, True)
    )
    assert torch.equal(out, torch.zeros(3, 48))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_row_alone_equals_row_in_batch(dtype: torch.dtype) -> None:
    """Bitwise: the tiling does not follow the token count, and each row's sums run in a fixed order."""
    torch.manual_seed(3)
    bank = make_bank(dtype, "gelu_tanh", True, True)
    row_k = [3, 1, 4, 0, 2]
    ids, weights = routing(row_k, 8)
    x = torch.randn(len(row_k), 48).to(dtype)
    batch = triton_moe.moe_experts(x, ids, weights, bank)
    for row in range(len(row_k)):
        alone = triton_moe.moe_experts(x[row : row + 1], ids[row : row + 1], weights[row : row + 1], bank)
        assert torch.equal(alone[0], batch[row]), row
