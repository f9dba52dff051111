"""bf16 activations (--cpu-activations bf16: kernels/csrc/bf16_dot.h): the rounding against PyTorch's, and the
vdpbf16ps kernels against their definition (reference.bf16_linear_torch) bit for bit, for linears at the row,
output and input counts the issue names and for the experts at mixed k. They run where the CPU has AVX-512 BF16;
elsewhere a bf16-activation operand is refused by name (tested there)."""

from __future__ import annotations

import dataclasses
from types import ModuleType

import pytest
import torch

from moe_serve.kernels import ops
from moe_serve.kernels.packed import PackedWeight, PackError, WeightFormat, quantize
from moe_serve.kernels.reference import bf16_linear_torch
from moe_serve.kernels.vocabulary import ExpertWeights, kernel_format

pytestmark = pytest.mark.cpu_kernels


@pytest.fixture(scope="module")
def dot(ext: ModuleType) -> ModuleType:
    if not ext.has_bf16_dot():
        pytest.skip("this CPU has no AVX-512 BF16")
    return ext


def random(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def weight(n: int, k: int, seed: int) -> PackedWeight:
    w = quantize(random((n, k), seed, 0.1), WeightFormat.BF16).with_activations("bf16")
    assert w.activations == "bf16"
    return w


def linear(ext: ModuleType, x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return ext.linear_packed(x, w.data, w.scales, kernel_format(w), bias)


# ---- the rounding -------------------------------------------------------------------------------------


def test_the_rounding_is_pytorchs_on_every_kind_of_value(dot: ModuleType) -> None:
    """Random, ties (exactly half a bf16 step: to even), NaN, infinities, values that round up to infinity,
    subnormals, signed zeros, and a tail after the last 16 values."""
    values = [random((61,), 0, 3.0)]
    one = torch.tensor(1.0)
    step = 2.0**-8  # half a bf16 step above 1 is 2^-8
    values.append(torch.tensor([1 + step, 1 + 3 * step, -(1 + step), 3.3895314e38, -3.3895314e38, 3.4e38]))
    values.append(torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40, 1e-45]))
    values.append(one.repeat(3))
    x = torch.cat(values).reshape(1, -1)
    got = dot.round_activations_bf16(x)
    want = x.to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16).masked_fill(want.isnan(), 0x7FC0))


@pytest.mark.parametrize("m", [1, 2, 3, 17, 130])
def test_the_rounding_is_pytorchs_at_any_row_count(dot: ModuleType, m: int) -> None:
    x = random((m, 96), m, 10.0)
    assert torch.equal(dot.round_activations_bf16(x).view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


# ---- the dot products ---------------------------------------------------------------------------------

SHAPES = sorted(
    {(m, 48, 1024) for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64, 130)}
    | {(3, n, 1024) for n in (16, 48, 1000, 2048, 32000)}
    | {(9, 1000, k) for k in (32, 1024, 4096)}
)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_kernel_equals_its_definition(dot: ModuleType, shape: tuple[int, int, int]) -> None:
    m, n, k = shape
    x, w, bias = random((m, k), m + n + k, 2.0), weight(n, k, n + k), random((n,), n)
    assert torch.equal(linear(dot, x, w, bias), bf16_linear_torch(x, w.data, bias))
    assert torch.equal(linear(dot, x, w), bf16_linear_torch(x, w.data))


def test_a_row_alone_equals_the_same_row_in_any_batch(dot: ModuleType) -> None:
    x, w = random((67, 256), 1, 2.0), weight(40, 256, 2)
    together = linear(dot, x, w)
    for m in (0, 1, 5, 33, 66):
        assert torch.equal(linear(dot, x[m : m + 1], w), together[m : m + 1])
    assert torch.equal(linear(dot, x[3:10], w), together[3:10])


def test_bf16_activations_stay_near_the_fp32_activations(dot: ModuleType) -> None:
    x, w = random((16, 1024), 8), weight(512, 1024, 9)
    exact = ops.linear(x, w.with_activations("fp32"))
    got = ops.linear(x, w)
    assert not torch.equal(got, exact)
    assert ((got - exact).norm() / exact.norm()).item() < 0.01


def test_non_finite_activations_stay_in_their_row(dot: ModuleType) -> None:
    x, w = random((3, 64), 4), weight(24, 64, 5)
    x[0, 3], x[2, 40] = float("nan"), float("inf")
    y = linear(dot, x, w)
    assert not torch.isfinite(y[0]).any() and not torch.isfinite(y[2]).any() and torch.isfinite(y[1]).all()


# ---- which weights take them ---------------------------------------------------------------------------


def test_only_bf16_weights_whose_k_is_a_multiple_of_32_take_bf16_activations(ext: ModuleType) -> None:
    x = random((2, 48), 10)
    odd = quantize(random((8, 48), 11), WeightFormat.BF16)
    assert odd.with_activations("bf16").activations == "fp32"  # K = 48: the chunks of 32 do not divide it
    int8 = quantize(random((8, 64), 12), WeightFormat.INT8)
    assert int8.with_activations("bf16").activations == "fp32"  # no bf16 kernels for int8 weights
    with pytest.raises(PackError, match="int8 weights cannot take bf16 activations"):
        dataclasses.replace(int8, activations="bf16")
    expected = "K a multiple of 32" if ext.has_bf16_dot() else "need AVX-512 BF16"
    with pytest.raises(RuntimeError, match=expected):
        ext.linear_packed(x, odd.data, None, "bf16/bf16", None)


def test_without_avx512_bf16_the_kernels_refuse_bf16_activations_by_name(ext: ModuleType) -> None:
    if ext.has_bf16_dot():
        pytest.skip("this CPU has AVX-512 BF16")
    w = quantize(random((8, 64), 13), WeightFormat.BF16)
    with pytest.raises(RuntimeError, match="bf16 activations need AVX-512 BF16"):
        ext.linear_packed(random((2, 64), 14), w.data, None, "bf16/bf16", None)


# ---- the experts ----------------------------------------------------------------------------------------


def bank(activations: str, experts: int = 4, hidden: int = 64, inner: int = 96) -> ExpertWeights:
    def packed(shape: tuple[int, ...], seed: int) -> PackedWeight:
        return quantize(random(shape, seed, 0.2), WeightFormat.BF16).with_activations(activations)

    return ExpertWeights(
        w1=packed((experts, inner, hidden), 20),
        w3=packed((experts, inner, hidden), 21),
        w2=packed((experts, hidden, inner), 22),
        activation="silu",
    )


def test_the_experts_with_bf16_activations_are_batch_invariant_at_mixed_k(dot: ModuleType) -> None:
    """Tokens at k = 1 and k = 3 in one call: each token's output equals its output alone, bitwise; the up
    projection equals the definition on the slots' rows."""
    experts = bank("bf16")
    x = random((6, 64), 30)
    generator = torch.Generator().manual_seed(31)
    ids = torch.stack([torch.randperm(4, generator=generator)[:3] for _ in range(6)])
    ids[::2, 1:] = -1  # even tokens at k = 1
    weights = torch.softmax(torch.randn(6, 3, generator=generator), -1)
    together = ops.moe_experts(x, ids, weights, experts)
    for t in range(6):
        alone = ops.moe_experts(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], experts)
        assert torch.equal(alone, together[t : t + 1])
    exact = ops.moe_experts(x, ids, weights, bank("fp32"))
    assert not torch.equal(together, exact) and ((together - exact).norm() / exact.norm()).item() < 0.02
