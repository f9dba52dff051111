"""The Triton RMSNorm and rotary + cache write kernels under Triton's interpreter (TRITON_INTERPRET=1, CPU
tensors) against the plain-torch paths: ops.rms_norm's fp32 formula, positions.apply_rotary and the cache
stores of ops.rotary_write. Outputs and caches start as NaN where that proves each element written (or,
for skipped slots, left alone)."""

from __future__ import annotations

import pytest
import torch

from moe_serve.kernels.vocabulary import cache_shapes
from moe_serve.layers.positions import apply_rotary, rotary_cos_sin

pytestmark = pytest.mark.triton_interp

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 48), (3, 4, 24), (2, 5000)])
def test_rms_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    # 48 and 24: chunks wider than the rows; 5000: two 4096-wide chunks, the second mostly masked.
    from moe_serve.kernels.cuda.norm import rms_norm

    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    weight = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
    got = rms_norm(x, weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, rms_norm_torch(x, weight, 1e-6), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_rms_norm_head_view() -> None:
    # Per-head q norm on a view of a fused projection: [T, H, Dh] that is no view of [T * H, Dh].
    from moe_serve.kernels.cuda.norm import rms_norm

    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(4, 3 * 2 * 16, generator=gen)
    q = qkv[:, : 2 * 16].view(4, 2, 16)
    weight = torch.rand(16, generator=gen) + 0.5
    torch.testing.assert_close(rms_norm(q, weight, 1e-5), rms_norm_torch(q, weight, 1e-5), atol=1e-5, rtol=1e-5)


BLOCK_SIZE = 16


def rotary_case(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, seed: int):
    """q, k, v as views of one fused projection (T = 5), cos/sin of scattered positions, NaN caches of
    4 blocks, slots in two of them (block 0 never: where a padding row (-1) taken as a slot would land)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = 5
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    cos, sin = rotary_cos_sin(torch.tensor([0, 3, 17, 40, 2]), head_dim, 10000.0)
    k_shape, v_shape = cache_shapes(4, BLOCK_SIZE, kv_heads, head_dim)
    cache = torch.full(k_shape, float("nan"), dtype=dtype), torch.full(v_shape, float("nan"), dtype=dtype)
    slots = torch.tensor([2 * BLOCK_SIZE + 3, 2 * BLOCK_SIZE + 15, -1, BLOCK_SIZE + 5, 2 * BLOCK_SIZE + 4])
    return q, k, v, (cos, sin), cache, slots


def reference(q, k, v, rotary, cache, slots):  # type: ignore[no-untyped-def]
    """positions.apply_rotary, then ops.rotary_write's cache stores for the rows with a slot."""
    if rotary is not None:
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
    if cache is not None:
        kept = slots >= 0
        blocks, offsets = slots[kept] // BLOCK_SIZE, slots[kept] % BLOCK_SIZE
        cache[0][blocks, :, :, offsets] = k[kept]
        cache[1][blocks, :, offsets, :] = v[kept]
    return q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (3, 3, 24)])
def test_rotary_write(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    from moe_serve.kernels.cuda.norm import rotary_write

    q, k, v, rotary, cache, slots = rotary_case(dtype, heads, kv_heads, head_dim, seed=head_dim)
    want_cache = tuple(c.clone() for c in cache)
    want_q, want_k = reference(q, k, v, rotary, want_cache, slots)
    got_q, got_k = rotary_write(q, k, v, *rotary, *cache, slots)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got_q, want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(got_k, want_k, atol=tol, rtol=tol)
    # Written slots match, and every other slot (the padding row's included) is still NaN.
    for got, want in zip(cache, want_cache, strict=True):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, equal_nan=True)
    assert int(cache[0].isnan().logical_not().sum()) == 4 * kv_heads * head_dim


def test_cache_write_without_rotary() -> None:
    from moe_serve.kernels.cuda.norm import rotary_write

    q, k, v, _, cache, slots = rotary_case(torch.float32, 2, 1, 32, seed=8)
    want_cache = tuple(c.clone() for c in cache)
    reference(q, k, v, None, want_cache, slots)
    got_q, got_k = rotary_write(q, k, v, None, None, *cache, slots)
    assert got_q is q and got_k is k
    for got, want in zip(cache, want_cache, strict=True):
        torch.testing.assert_close(got, want, equal_nan=True)


def test_rotary_without_cache() -> None:
    from moe_serve.kernels.cuda.norm import rotary_write

    q, k, v, rotary, _, _ = rotary_case(torch.float32, 4, 2, 16, seed=9)
    want_q, want_k = reference(q, k, v, rotary, None, None)
    got_q, got_k = rotary_write(q, k, v, *rotary, None, None, None)
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k, atol=1e-6, rtol=1e-6)
