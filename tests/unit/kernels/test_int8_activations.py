"""int8 activations (--cpu-activations int8; kernels/csrc/int_dot.h): the activation quantizer and the
integer-block kernels for int8 and int4 weights, each *bitwise* equal to its torch definition in
moe_serve.kernels.reference (a block's integer dot product is exact, and the float sum over blocks runs in an
order fixed by K), so a row's result is the same alone and in any batch; the experts under it, batch-invariant
bitwise at mixed k and near the fp32-activation experts. Both builds: the kernels use the same AVX2 integer
instructions on each, and test_packed_kernels.py's AVX2 run covers the build flags."""

from __future__ import annotations

import dataclasses
from types import ModuleType

import pytest
import torch

from moe_serve.kernels import ops
from moe_serve.kernels.packed import GROUP_SIZE, PackedWeight, PackError, WeightFormat, quantize, tile, untile
from moe_serve.kernels.reference import int8_linear_torch, quantize_activations_torch
from moe_serve.kernels.vocabulary import ExpertWeights, kernel_format

GROUPED = (WeightFormat.INT8, WeightFormat.INT4)


def random(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def weight(n: int, k: int, fmt: WeightFormat, seed: int, tiled: bool = True) -> PackedWeight:
    """With int8 activations: in tiles of 8 rows (n a multiple of 8), or its rows as stored."""
    packed = quantize(random((n, k), seed, 0.1), fmt)
    return packed.with_activations("int8") if tiled else dataclasses.replace(packed, activations="int8")


# ---- the quantizer ------------------------------------------------------------------------------------


def blocks_of_every_kind() -> torch.Tensor:
    """Rows of 4 blocks: random, all zero, ties (values that land exactly on .5 steps), huge, tiny (1e-30),
    subnormal (under 2^-120: zero), one value with the rest zero, and negative extremes."""
    k = 4 * GROUP_SIZE
    rows = [random((k,), 0), torch.zeros(k)]
    ties = (torch.arange(k) % 9 - 4).float() * 0.5  # max 2 -> d = 2/127; x * (1/d) lands on halves often
    ties[0] = 127 / 2 * 2  # the block's maximum, 127 steps exactly
    rows += [ties, random((k,), 1, 1e30), random((k,), 2, 1e-30), random((k,), 2, 1e-40)]
    rows.append(torch.zeros(k).index_fill_(0, torch.tensor([5]), 3.0))
    rows.append(-random((k,), 3).abs())
    halves = torch.full((k,), 0.5)
    halves[::GROUP_SIZE] = 127.0  # d = 1: every other value is exactly 0.5 -> 0 (ties to even)
    rows.append(halves)
    return torch.stack(rows)


def test_the_quantizer_equals_its_definition_on_every_kind_of_block(ext: ModuleType) -> None:
    x = blocks_of_every_kind()
    got, want = ext.quantize_activations(x), quantize_activations_torch(x)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)
    q, d, s = got
    assert torch.equal(q[1], torch.zeros_like(q[1])) and torch.equal(d[1], torch.zeros_like(d[1]))
    assert q.abs().max() == 127 and torch.equal(s, q.reshape(len(x), -1, GROUP_SIZE).sum(-1, dtype=torch.int32))
    assert (q[-1].reshape(-1, GROUP_SIZE)[:, 1:] == 0).all()  # 0.5 steps round to even: 0
    assert (q[2] != 0).any() and (q[4] != 0).any()  # ties and tiny blocks keep their values
    assert not q[5].any() and not d[5].any()  # blocks under 2^-120: zero


@pytest.mark.parametrize("m", range(1, 131))
def test_the_quantizer_equals_its_definition_at_every_row_count(ext: ModuleType, m: int) -> None:
    x = random((m, 2 * GROUP_SIZE), m, 3.0)
    for g, w in zip(ext.quantize_activations(x), quantize_activations_torch(x), strict=True):
        assert torch.equal(g, w)


def test_non_finite_activations_give_non_finite_outputs_in_their_row_only(ext: ModuleType) -> None:
    x = random((3, 64), 4)
    x[0, 3], x[2, 40] = float("nan"), float("inf")
    w = weight(24, 64, WeightFormat.INT8, 5)
    y = ext.linear_packed(x, w.data, w.scales, kernel_format(w), None)
    assert not torch.isfinite(y[0]).any() and not torch.isfinite(y[2]).any() and torch.isfinite(y[1]).all()


# ---- the integer kernels ------------------------------------------------------------------------------

SHAPES = sorted(
    {(m, 48, 1024) for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64, 130)}
    | {(3, n, 1024) for n in (16, 48, 1000, 2048, 32000)}
    | {(9, 1000, k) for k in (32, 1024, 4096)}
)


@pytest.mark.parametrize("tiled", [True, False], ids=["tiles", "rows"])
@pytest.mark.parametrize("fmt", GROUPED, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_kernel_equals_its_definition(
    ext: ModuleType, fmt: WeightFormat, shape: tuple[int, int, int], tiled: bool
) -> None:
    """Both layouts of the weight, the same bits as the definition."""
    m, n, k = shape
    x, w, bias = random((m, k), m + n + k, 2.0), weight(n, k, fmt, n + k, tiled), random((n,), n)
    assert w.tiled == tiled
    with_bias = ext.linear_packed(x, w.data, w.scales, kernel_format(w), bias)
    assert torch.equal(with_bias, int8_linear_torch(x, w, bias))
    assert torch.equal(ext.linear_packed(x, w.data, w.scales, kernel_format(w), None), int8_linear_torch(x, w))


@pytest.mark.parametrize("fmt", GROUPED, ids=str)
@pytest.mark.parametrize("n", [5, 13, 1001])
def test_rows_not_a_multiple_of_8_stay_as_stored(ext: ModuleType, fmt: WeightFormat, n: int) -> None:
    x, w = random((3, 64), n, 2.0), weight(n, 64, fmt, n)
    assert w.activations == "int8" and not w.tiled
    assert torch.equal(ops.linear(x, w), int8_linear_torch(x, w))


@pytest.mark.parametrize("fmt", GROUPED, ids=str)
def test_tiles_hold_the_weight_exactly(fmt: WeightFormat) -> None:
    """Repacked then dequantized: the weight as stored; views and fusions of tiles: the rows' own."""
    stored = dataclasses.replace(quantize(random((3, 24, 96), 17), fmt), activations="int8")  # a bank [E, N, K]
    tiled = tile(stored)
    assert tiled.tiled and tiled.data.shape[-3:] == (3, 3, 256 if fmt is WeightFormat.INT8 else 128)
    assert torch.equal(untile(tiled).data, stored.data) and torch.equal(untile(tiled).scales, stored.scales)
    assert torch.equal(tiled.dequantize(), stored.dequantize())
    assert torch.equal(tiled.rows(8, 24).dequantize(), stored.dequantize()[..., 8:24, :])
    assert not tiled.rows(4, 12).tiled and torch.equal(
        tiled.rows(4, 12).dequantize(), stored.dequantize()[..., 4:12, :]
    )
    fused = PackedWeight.cat_rows([tiled.rows(0, 8), tiled.rows(16, 24)])
    assert fused.tiled and torch.equal(fused.dequantize(), stored.dequantize()[..., [*range(8), *range(16, 24)], :])
    assert all(torch.equal(a, b) for a, b in zip(tiled.stored("w").values(), stored.stored("w").values(), strict=True))


@pytest.mark.parametrize("fmt", GROUPED, ids=str)
def test_a_row_alone_equals_the_row_in_any_batch(ext: ModuleType, fmt: WeightFormat) -> None:
    x, w = random((130, 256), 6), weight(1000, 256, fmt, 7)
    batch = ops.linear(x, w)
    for row in (0, 4, 63, 129):
        assert torch.equal(ops.linear(x[row : row + 1], w), batch[row : row + 1])
        assert torch.equal(ops.linear(x[row : row + 5], w)[0], batch[row])


@pytest.mark.parametrize("fmt", GROUPED, ids=str)
def test_int8_activations_stay_near_the_fp32_activations(ext: ModuleType, fmt: WeightFormat) -> None:
    """The rounding of the activations, not a different product: relative error ~1/254 per block, averaging out."""
    x, w = random((16, 1024), 8), weight(512, 1024, fmt, 9)
    exact = ops.linear(x, w.with_activations("fp32"))
    got = ops.linear(x, w)
    assert not torch.equal(got, exact)
    assert ((got - exact).norm() / exact.norm()).item() < 0.01


def test_only_int8_and_int4_weights_take_int8_activations(ext: ModuleType) -> None:
    x = random((2, 64), 10)
    bf16 = quantize(random((8, 64), 11), WeightFormat.BF16)
    assert bf16.with_activations("int8").activations == "fp32"  # a format without integer kernels keeps fp32
    with pytest.raises(PackError, match="bf16 weights cannot take int8 activations"):
        PackedWeight(WeightFormat.BF16, bf16.data, None, bf16.shape, activations="int8")
    with pytest.raises(RuntimeError, match="int8 and int4 weights take int8 activations"):
        ext.linear_packed(x, bf16.data, None, "bf16/int8", None)
    w = weight(8, 64, WeightFormat.INT8, 12)
    with pytest.raises(RuntimeError, match="bf16 weights bf16 ones"):
        ext.linear_packed(x, w.data, w.scales, "int8/bf16", None)


# ---- the experts ----------------------------------------------------------------------------------------


def bank(
    fmt: WeightFormat, activations: str, experts: int = 4, hidden: int = 64, inner: int = 96, tiled: bool = True
) -> ExpertWeights:
    def packed(shape: tuple[int, ...], seed: int) -> PackedWeight:
        weight = quantize(random(shape, seed, 0.2), fmt)
        return weight.with_activations(activations) if tiled else dataclasses.replace(weight, activations=activations)

    return ExpertWeights(
        w1=packed((experts, inner, hidden), 20),
        w3=packed((experts, inner, hidden), 21),
        w2=packed((experts, hidden, inner), 22),
        activation="silu",
    )


def routing(tokens: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(4, generator=generator)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=generator), -1)
    return ids, weights


@pytest.mark.parametrize("tiled", [True, False], ids=["tiles", "rows"])
@pytest.mark.parametrize("fmt", GROUPED, ids=str)
def test_the_experts_with_int8_activations_are_batch_invariant_at_mixed_k(
    ext: ModuleType, fmt: WeightFormat, tiled: bool
) -> None:
    """Tokens at k = 1 and k = 3 in one call: each token's output equals its output alone, bitwise, in either
    layout of the banks, and the two layouts give the same bits."""
    experts = bank(fmt, "int8", tiled=tiled)
    x = random((9, 64), 13)
    ids, weights = routing(9, 3, 14)
    ids[::2, 1:] = -1  # every other token at k = 1
    weights[::2, 1:] = 0.0
    weights[::2, 0] = 1.0
    together = ops.moe_experts(x, ids, weights, experts)
    assert torch.equal(together, ops.moe_experts(x, ids, weights, bank(fmt, "int8", tiled=not tiled)))
    for t in range(9):
        alone = ops.moe_experts(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], experts)
        assert torch.equal(alone[0], together[t])


@pytest.mark.parametrize("fmt", GROUPED, ids=str)
def test_the_experts_quantize_both_projections_inputs(ext: ModuleType, fmt: WeightFormat) -> None:
    """Against the same experts in fp32 activations: close, not equal; and against a torch composition of the
    integer linears (the up projections' inputs quantized per slot, the down projection's after the activation),
    within the epilogue's float tolerance."""
    x = random((5, 64), 15)
    ids, weights = routing(5, 2, 16)
    got = ops.moe_experts(x, ids, weights, bank(fmt, "int8"))
    exact = ops.moe_experts(x, ids, weights, bank(fmt, "fp32"))
    assert not torch.equal(got, exact) and ((got - exact).norm() / exact.norm()).item() < 0.02
    experts = bank(fmt, "int8")
    want = torch.zeros_like(x)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            row = x[t : t + 1]
            gate = int8_linear_torch(row, _expert(experts.w1, e))
            up = int8_linear_torch(row, _expert(experts.w3, e))
            h = torch.nn.functional.silu(gate) * up
            want[t] += weights[t, j] * int8_linear_torch(h, _expert(experts.w2, e))[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _expert(w: PackedWeight, e: int) -> PackedWeight:
    assert w.scales is not None
    return dataclasses.replace(w, data=w.data[e], scales=w.scales[e], shape=w.shape[1:])
