"""Packed weights (moe_serve/kernels/packed.py: bf16, int8, int4) in the C++ CPU kernels, on both builds
(AVX-512 where the CPU has it, and AVX2: this file again in a process of its own).

The kernels unpack each weight to exactly packed.dequantize's value and run the fp32 kernels' FMA chains, so
their results are asserted *bitwise* equal to the fp32 kernels' on the dequantized weights, which makes each
row's result independent of its batch as on fp32; against PyTorch on the dequantized weights (another
summation order) they agree within rtol = atol = 1e-5 (linear) and 1e-4 (experts, two matrices deep)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.nn import functional as F

from moe_serve import kernels
from moe_serve.kernels import cpu_extension, ops
from moe_serve.kernels.packed import (
    GROUP_SIZE,
    PACKED_FORMATS,
    PackedWeight,
    WeightFormat,
    dequantize,
    from_stored,
    quantize,
)
from moe_serve.kernels.reference import moe_experts_torch
from moe_serve.kernels.vocabulary import ACTIVATION_IDS, ACTIVATIONS, LINEAR_MAX_ROWS, ExpertWeights, Weight

BATCHES = (1, 3, 17, 64, 100)
ACTIVATIONS = tuple(ACTIVATIONS)  # the clamped SwiGLU (a GLU only, with parameters): test_swiglu_clamp.py

# ---- packed.py: the definition the kernels are tested against ----------------------------------------


@pytest.mark.parametrize("fmt", PACKED_FORMATS)
def test_quantizing_a_dequantized_weight_gives_it_back(fmt: WeightFormat) -> None:
    weight = torch.randn(6, 4 * GROUP_SIZE, generator=torch.Generator().manual_seed(0))
    once = quantize(weight, fmt).dequantize()
    again = quantize(once, fmt)
    assert torch.equal(again.dequantize(), once)
    stored = again.stored("w")
    rebuilt = from_stored(fmt, {name.removeprefix("w"): t for name, t in stored.items()}, again.shape)
    assert torch.equal(dequantize(rebuilt), once)


def test_int4_uses_all_16_levels_and_maps_each_groups_extreme_to_minus_8() -> None:
    levels = torch.arange(-8, 8, dtype=torch.float32)  # 16 values; a group holds them twice
    weight = torch.stack([levels.repeat(2) * 0.25, -levels.repeat(2) * 3.0])  # extremes -2.0 and +24.0
    packed = quantize(weight, WeightFormat.INT4)
    nibbles = torch.cat([packed.data & 0xF, packed.data >> 4], dim=-1)
    assert set(nibbles.unique().tolist()) == set(range(16))
    assert torch.equal(packed.dequantize(), weight)  # every level is hit exactly
    assert nibbles[:, 0].tolist() == [0, 0]  # -2.0 and +24.0 (the extremes, sign kept) are both level -8


@pytest.mark.parametrize("fmt", [WeightFormat.INT8, WeightFormat.INT4])
def test_a_zero_group_has_scale_zero_and_stays_zero(fmt: WeightFormat) -> None:
    weight = torch.randn(3, 3 * GROUP_SIZE, generator=torch.Generator().manual_seed(1))
    weight[1, GROUP_SIZE : 2 * GROUP_SIZE] = 0
    packed = quantize(weight, fmt)
    assert packed.scales is not None and packed.scales[1, 1] == 0
    restored = packed.dequantize()
    assert torch.isfinite(restored).all()
    assert torch.equal(restored[1, GROUP_SIZE : 2 * GROUP_SIZE], torch.zeros(GROUP_SIZE))


@pytest.mark.parametrize("fmt,levels,steps", [(WeightFormat.INT8, 127, 0.5), (WeightFormat.INT4, 8, 1.0)])
def test_grouped_rounding_error_is_bounded_by_the_step(fmt: WeightFormat, levels: int, steps: float) -> None:
    """|w - dequantize(w)| per group, in steps d = max|w| / levels (plus the fp16 rounding of d): half a step
    for int8; for int4 a whole one, where a value lies past 7.5 steps on the side opposite the group's
    extreme (16 levels, -8..7: the clamp at 7)."""
    weight = torch.randn(64, 8 * GROUP_SIZE, generator=torch.Generator().manual_seed(2)) * 3
    error = (quantize(weight, fmt).dequantize() - weight).abs().reshape(64, 8, GROUP_SIZE).amax(-1)
    step = weight.abs().reshape(64, 8, GROUP_SIZE).amax(-1) / levels
    assert (error <= step * (steps + 2**-10)).all()
    assert error.max() > step.max() * 0.1  # not vacuous


def test_bf16_rounds_to_nearest() -> None:
    weight = torch.randn(8, 40, generator=torch.Generator().manual_seed(3))
    assert torch.equal(quantize(weight, WeightFormat.BF16).dequantize(), weight.to(torch.bfloat16).float())


# ---- the kernels, on both builds ----------------------------------------------------------------------


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """For the torch reference: its CPU grouped GEMM on these tiny groups takes ~0.02 ms on one thread and,
    on two cores that another process keeps busy, ~60 ms on two (its threads wait out scheduler slices)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ext() -> ModuleType:
    """The kernels, for the tests marked cpu_kernels (skipped where they do not build)."""
    native = cpu_extension()
    assert native is not None
    return native


@pytest.mark.cpu_kernels
def test_the_build_is_the_isa_asked_for(ext: ModuleType) -> None:
    assert ext.isa() == kernels.target_isa()  # avx2 in the run below
    assert ext.weight_formats() == [f.value for f in WeightFormat]  # one table of names, C++ and Python


@pytest.mark.slow
@pytest.mark.skipif(
    kernels.target_isa() != "avx512" or os.environ.get("MOE_SERVE_KERNEL_ISA") == "avx2",
    reason="the native build is the AVX2 one",
)
def test_the_avx2_build_passes_these_tests() -> None:
    """The AVX2 build, in a process of its own: Python keeps one extension module of a name per process (a
    second library of it loads as the first), so MOE_SERVE_KERNEL_ISA=avx2 runs this file again, and the int8
    activations' (whose bits the definition fixes on either build: vpdpbusd or vpmaddubsw), and the refusals
    of the bf16 activations' file."""
    env = {**os.environ, "MOE_SERVE_KERNEL_ISA": "avx2"}
    env.pop("MOE_SERVE_KERNELS", None)
    int8 = str(Path(__file__).with_name("test_int8_activations.py"))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, int8, "-k", "not avx2_build"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
    # Without AVX-512 BF16 the bf16 activations' kernels refuse by name (their bits need vdpbf16ps).
    bf16 = str(Path(__file__).with_name("test_bf16_activations.py"))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", bf16, "-k", "refuse or only_bf16"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "2 passed" in result.stdout, result.stdout[-3000:] + result.stderr[-2000:]


def _linear(ext: ModuleType, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, PackedWeight):
        return ext.linear_packed(x, weight.data, weight.scales, weight.format.value, bias)
    return ext.linear(x, weight, bias)


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("fmt", PACKED_FORMATS)
@pytest.mark.parametrize("n,k", [(37, 64), (130, 96), (11, 1024), (333, 256)])  # the last: threads, an odd range
def test_linear_is_the_fp32_kernel_on_the_dequantized_weight(
    ext: ModuleType, fmt: WeightFormat, n: int, k: int
) -> None:
    generator = torch.Generator().manual_seed(n * k)
    packed = quantize(torch.randn(n, k, generator=generator) / k**0.5, fmt)  # outputs of order 1
    bias = torch.randn(n, generator=generator)
    x = torch.randn(max(BATCHES), k, generator=generator)
    dense = packed.dequantize()
    alone = torch.cat([_linear(ext, x[i : i + 1], packed, bias) for i in range(len(x))])
    for m in (*BATCHES, 2, 4, 5):  # every block shape: single rows, pairs, register blocks, tails
        assert torch.equal(_linear(ext, x[:m], packed, bias), ext.linear(x[:m], dense, bias)), m
        assert torch.equal(_linear(ext, x[:m], packed, bias), alone[:m]), m
    shuffled = torch.randperm(len(x), generator=generator)
    assert torch.equal(_linear(ext, x[shuffled], packed, None), _linear(ext, x, packed, None)[shuffled])
    torch.testing.assert_close(alone, F.linear(x, dense, bias), rtol=1e-5, atol=1e-5)


UNEVEN_K = [
    (f, k)
    for f in WeightFormat
    for k in (32, 32 * 5, 32 * 7, 16 * 7 + 3, 16 * 9, 5)
    if k % GROUP_SIZE == 0 or f in (WeightFormat.FP32, WeightFormat.BF16)
]


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("fmt,k", UNEVEN_K, ids=[f"{f.value}-k{k}" for f, k in UNEVEN_K])
def test_linear_rows_are_batch_invariant_at_any_k(ext: ModuleType, fmt: WeightFormat, k: int) -> None:
    """Each row alone and in every batch (one row of W at a time up to 4 rows of X, register blocks above
    with their tails in X and in W: 13 rows), bitwise, at uneven K: an odd number of 32-value groups, a
    single group, and for the float formats an odd number of 16-value vectors and a tail shorter than 16."""
    generator = torch.Generator().manual_seed(k)
    w = torch.randn(13, k, generator=generator) / k**0.5
    weight = w if fmt is WeightFormat.FP32 else quantize(w, fmt)
    x = torch.randn(67, k, generator=generator)
    alone = torch.cat([_linear(ext, x[i : i + 1], weight, None) for i in range(len(x))])
    for m in (1, 2, 3, 4, 5, 6, 9, 10, 11, 64, 67):
        assert torch.equal(_linear(ext, x[:m], weight, None), alone[:m]), m
    if isinstance(weight, PackedWeight):
        assert torch.equal(alone, ext.linear(x, weight.dequantize(), None))
    torch.testing.assert_close(
        alone, F.linear(x, w if fmt is WeightFormat.FP32 else weight.dequantize()), rtol=1e-5, atol=1e-5
    )


def _bank(fmt_up: WeightFormat, fmt_down: WeightFormat, gated: bool, biases: bool, activation: str, seed: int):
    generator = torch.Generator().manual_seed(seed)
    experts, d, inner = 4, 64, 96

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.2

    def pack(w: torch.Tensor, fmt: WeightFormat) -> Weight:
        return w if fmt is WeightFormat.FP32 else quantize(w, fmt)

    def bias(*shape: int) -> torch.Tensor | None:
        return weight(*shape) if biases else None

    return ExpertWeights(
        w1=pack(weight(experts, inner, d), fmt_up),
        w2=pack(weight(experts, d, inner), fmt_down),
        activation=activation,
        b1=bias(experts, inner),
        w3=pack(weight(experts, inner, d), fmt_up) if gated else None,
        b3=bias(experts, inner) if gated else None,
        b2=bias(experts, d),
    )


def _moe(ext: ModuleType, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, bank: ExpertWeights):
    def parts(w: Weight | None) -> tuple:
        if w is None:
            return None, None
        return (w.data, w.scales) if isinstance(w, PackedWeight) else (w, None)

    def name(w: Weight) -> str:
        return w.format.value if isinstance(w, PackedWeight) else {torch.float32: "fp32"}[w.dtype]

    up, down = name(bank.w1), name(bank.w2)
    act = (ACTIVATION_IDS[bank.activation], 0.0, 0.0)  # no clamped SwiGLU here: no alpha, no limit
    return ext.moe_experts_packed(
        x, ids, weights, up, *parts(bank.w1), bank.b1, *parts(bank.w3), bank.b3, down, *parts(bank.w2), bank.b2, *act
    )


def _routing(tokens: int, experts: int, k: int | None, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, experts] (k of them used per token, -1 after; k None: each token its own k, 0..experts) and
    weights."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=generator) for _ in range(tokens)])
    token_k = (
        torch.full((tokens,), k) if k is not None else torch.randint(0, experts + 1, (tokens,), generator=generator)
    )
    ids[torch.arange(experts)[None, :] >= token_k[:, None]] = -1
    return ids, torch.rand(tokens, experts, generator=generator)


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("fmt", PACKED_FORMATS)
@pytest.mark.parametrize("gated", [True, False], ids=["glu", "mlp"])
@pytest.mark.parametrize("biases", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_moe_experts_are_the_fp32_kernel_on_the_dequantized_bank(
    ext: ModuleType, fmt: WeightFormat, gated: bool, biases: bool, activation: str
) -> None:
    """Every k from 1 to E and a mix of k per token (unused slots -1, a token with none): bitwise the fp32
    kernel on the dequantized bank, close to the torch reference."""
    bank = _bank(fmt, fmt, gated, biases, activation, seed=len(activation))
    dense = bank.dequantized(torch.float32)
    x = torch.randn(19, 64, generator=torch.Generator().manual_seed(5))
    for k in (1, 2, 3, 4, None):
        ids, weights = _routing(len(x), 4, k, seed=k or 0)
        out = _moe(ext, x, ids, weights, bank)
        assert torch.equal(out, _moe(ext, x, ids, weights, dense)), k
        with one_thread():
            reference = moe_experts_torch(x, ids, weights, dense)
        torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("up,down", [(WeightFormat.INT4, WeightFormat.INT8), (WeightFormat.INT8, WeightFormat.FP32)])
def test_moe_experts_read_each_projection_in_its_format(ext: ModuleType, up: WeightFormat, down: WeightFormat) -> None:
    bank = _bank(up, down, gated=True, biases=True, activation="silu", seed=6)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(6))
    ids, weights = _routing(len(x), 4, None, seed=6)
    assert torch.equal(_moe(ext, x, ids, weights, bank), _moe(ext, x, ids, weights, bank.dequantized(torch.float32)))


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("fmt", PACKED_FORMATS)
def test_moe_experts_rows_are_batch_invariant(ext: ModuleType, fmt: WeightFormat) -> None:
    bank = _bank(fmt, fmt, gated=True, biases=True, activation="gelu", seed=7)
    x = torch.randn(max(BATCHES), 64, generator=torch.Generator().manual_seed(7))
    ids, weights = _routing(len(x), 4, None, seed=7)
    alone = torch.cat([_moe(ext, x[i : i + 1], ids[i : i + 1], weights[i : i + 1], bank) for i in range(len(x))])
    for m in BATCHES:
        assert torch.equal(_moe(ext, x[:m], ids[:m], weights[:m], bank), alone[:m]), m


@pytest.mark.cpu_kernels
@pytest.mark.parametrize(
    "change,message",
    [
        (lambda p: dict(scales=None), "needs its fp16 group scales"),
        (lambda p: dict(scales=p.scales.float()), "scales must be float16"),
        (lambda p: dict(scales=p.scales[:, :1]), "scales must be float16"),
        (lambda p: dict(data=p.data.view(torch.uint8)), "int8 data must be int8"),
        (lambda p: dict(format="int3"), "unknown weight format 'int3'"),
        (lambda p: dict(data=p.data[:, :48]), "a multiple of 32"),
    ],
)
def test_bad_operands_are_named(change, message: str) -> None:
    ext = cpu_extension()
    assert ext is not None
    packed = quantize(torch.randn(8, 64), WeightFormat.INT8)
    args = dict(data=packed.data, scales=packed.scales, format="int8") | change(packed)
    k = args["data"].shape[-1]
    with pytest.raises(RuntimeError, match=message):
        ext.linear_packed(torch.randn(2, k), args["data"], args["scales"], args["format"], None)


@pytest.mark.cpu_kernels
def test_a_mismatched_x_is_named() -> None:
    ext = cpu_extension()
    assert ext is not None
    packed = quantize(torch.randn(8, 64), WeightFormat.INT4)
    with pytest.raises(RuntimeError, match=r"x must be \[M, 64\]"):
        ext.linear_packed(torch.randn(2, 32), packed.data, packed.scales, "int4", None)


# ---- ops dispatch --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", PACKED_FORMATS)
def test_ops_take_packed_weights_on_every_path(fmt: WeightFormat, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ kernels at every M (bf16 tensors too), and the torch fallback on the dequantized weight."""
    generator = torch.Generator().manual_seed(8)
    packed = quantize(torch.randn(40, 64, generator=generator), fmt)
    x = torch.randn(LINEAR_MAX_ROWS + 3, 64, generator=generator)
    reference = F.linear(x, packed.dequantize())
    fast = ops.linear(x, packed)
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)
    if fmt is WeightFormat.BF16:
        assert torch.equal(ops.linear(x, packed.data), fast)
    half = ops.linear(x.bfloat16(), packed)  # not fp32 activations: the torch path, dequantized to bf16
    torch.testing.assert_close(half, F.linear(x.bfloat16(), packed.dequantize(torch.bfloat16)))
    bank = _bank(fmt, fmt, gated=True, biases=False, activation="silu", seed=8)
    xs = torch.randn(5, 64, generator=generator)
    ids, weights = _routing(len(xs), 4, 2, seed=8)
    fast_moe = ops.moe_experts(xs, ids, weights, bank)
    monkeypatch.setattr(ops, "_cpu_ext", lambda x: None)  # as without the extension
    torch.testing.assert_close(ops.linear(x, packed), fast, rtol=1e-5, atol=1e-5)
    with one_thread():
        fallback = ops.moe_experts(xs, ids, weights, bank)
    torch.testing.assert_close(fallback, fast_moe, rtol=1e-4, atol=1e-4)
