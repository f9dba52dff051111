"""Norms and positions as Triton kernels: RMSNorm, and rotary embedding with the cache write (one launch
for q, k and the k/v cache stores). Same results as the plain-torch paths of ops.rms_norm and
ops.rotary_write; fp32 math, the inputs' dtype out.

Legend: T tokens, H query heads, G key/value heads, Dh head dim, D normalized size, R rows, NB blocks,
BS block size.

Nothing syncs with the host: a padding row's slot (< 0) is tested on the device, and every grid follows
from the shapes alone.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from moe_serve.kernels.cuda.common import CompileSpec

NUM_WARPS = 4
TILE = 4096  # elements a program holds at once: 32 fp32 per thread with 4 warps, no spills
MAX_BLOCK_D = 4096  # wider rows are walked in chunks of this many
ROTARY_TILE = 1024  # heads x Dh of one rotary program: 8 per thread


# ---- RMSNorm ----------------------------------------------------------------------------------------


# Counts are never specialized (Triton would compile a variant for each that happens to be 1): what runs is
# what SM90_SPECS builds. Sizes and strides are, as Triton does (1, multiples of 16): they decide vector loads.
@triton.jit(do_not_specialize=["rows", "inner"])
def _rms_norm_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    rows,
    inner,
    dim,
    stride_xa,
    stride_xb,
    eps,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """BLOCK_R rows of x viewed as [A, inner, D] (row r is x[r // inner, r % inner]) into out [R, D]: two
    passes over each row's D in chunks of BLOCK_D, the sum of squares, then the scaled rows. One chunk for
    D <= 4096, so the second pass reads what the first left in L1/L2."""
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_valid = row < rows
    row = row.to(tl.int64)
    x_row = x_ptr + (row // inner) * stride_xa + (row % inner) * stride_xb
    out_row = out_ptr + row * dim
    squares = tl.zeros([BLOCK_R], tl.float32)
    for start in range(0, dim, BLOCK_D):
        dims = start + tl.arange(0, BLOCK_D)
        mask = row_valid[:, None] & (dims < dim)[None, :]
        x = tl.load(x_row[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)
        squares += tl.sum(x * x, 1)
    # As the torch path: x * rsqrt(mean(x^2) + eps), then the weight (in fp32).
    inv_rms = tl.rsqrt(squares / dim + eps)
    for start in range(0, dim, BLOCK_D):
        dims = start + tl.arange(0, BLOCK_D)
        mask = row_valid[:, None] & (dims < dim)[None, :]
        x = tl.load(x_row[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)
        weight = tl.load(weight_ptr + dims, mask=dims < dim, other=0.0).to(tl.float32)
        y = weight[None, :] * (x * inv_rms[:, None])
        tl.store(out_row[:, None] + dims[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (any strides but a unit last one: a head-split view of a fused projection is read in
    place), weight [D] -> x's dtype, contiguous."""
    dim = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    # [A, inner, D]: the last two leading dims keep their strides (q [T, H, Dh] of a fused qkv is no view
    # of [T * H, Dh]); further ones are merged (copied if they must be).
    x3 = x.reshape(-1, *x.shape[-2:]) if x.dim() >= 3 else x.reshape(-1, 1, dim)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x3.shape[0] * x3.shape[1]
    if rows == 0:
        return out
    config = rms_norm_config(dim)
    _rms_norm_kernel[(triton.cdiv(rows, config["BLOCK_R"]),)](
        x3, weight, out, rows, x3.shape[1], dim, x3.stride(0), x3.stride(1), eps, num_warps=NUM_WARPS, **config
    )
    return out


def rms_norm_config(dim: int) -> dict[str, int]:
    block_d = min(max(32, triton.next_power_of_2(dim)), MAX_BLOCK_D)
    return {"BLOCK_R": TILE // block_d, "BLOCK_D": block_d}


# ---- rotary embedding and cache write ---------------------------------------------------------------


@triton.jit
def _rotated(
    x_ptr,
    token,
    head,
    stride_t,
    stride_h,
    stride_d,
    cos_ptr,
    sin_ptr,
    stride_c,
    mask,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Rows x[token, head] rotated, HF rotate-half: x * cos + [-x2, x1] * sin, in fp32."""
    dims = tl.arange(0, BLOCK_D)
    half = HEAD_DIM // 2
    partner = tl.where(dims < half, dims + half, dims - half)
    row = x_ptr + token * stride_t + head[:, None] * stride_h
    x = tl.load(row + dims[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(row + partner[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    dim_valid = dims < HEAD_DIM
    cos = tl.load(cos_ptr + token * stride_c + dims, mask=dim_valid, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_c + dims, mask=dim_valid, other=0.0).to(tl.float32)
    rotated = tl.where(dims < half, -x_partner, x_partner)
    return x * cos[None, :] + rotated * sin[None, :]


@triton.jit(do_not_specialize=["heads", "kv_heads", "q_tiles"])
def _rotary_write_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    heads,
    kv_heads,
    q_tiles,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_c,
    ROTARY: tl.constexpr,
    CACHE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (token, tile): tiles below q_tiles rotate BLOCK_H query heads (rotary only); the rest take
    BLOCK_H kv heads: k rotated (rotary), k and v stored at the token's slot (cache). q, k, v through their
    strides; q_out [T, H, Dh], k_out [T, G, Dh], k_cache [NB, G, Dh, BS] (a key's Dh strided by BS: transposed
    inside its block) and v_cache [NB, G, BS, Dh] contiguous, cos and sin [T, Dh] with unit last stride."""
    token = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    if tile < q_tiles:
        if ROTARY:  # q_tiles is 0 otherwise
            head = tile * BLOCK_H + tl.arange(0, BLOCK_H)
            mask = (head < heads)[:, None] & dim_valid[None, :]
            q = _rotated(
                q_ptr, token, head, stride_qt, stride_qh, stride_qd, cos_ptr, sin_ptr, stride_c, mask, HEAD_DIM, BLOCK_D
            )
            out = q_out_ptr + (token * heads + head[:, None]) * HEAD_DIM + dims[None, :]
            tl.store(out, q.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        head = (tile - q_tiles) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (head < kv_heads)[:, None] & dim_valid[None, :]
        if ROTARY:
            k = _rotated(
                k_ptr, token, head, stride_kt, stride_kh, stride_kd, cos_ptr, sin_ptr, stride_c, mask, HEAD_DIM, BLOCK_D
            )
            k = k.to(k_out_ptr.dtype.element_ty)  # the cache holds the key as returned: rounded first
            out = k_out_ptr + (token * kv_heads + head[:, None]) * HEAD_DIM + dims[None, :]
            tl.store(out, k, mask=mask)
        else:
            k = tl.load(k_ptr + token * stride_kt + head[:, None] * stride_kh + dims[None, :] * stride_kd, mask=mask)
        if CACHE:
            slot = tl.load(slot_ptr + token)
            mask = mask & (slot >= 0)  # a padding row: nothing stored
            slot = tl.maximum(slot, 0)
            block = slot // BLOCK_SIZE
            offset = slot % BLOCK_SIZE
            head_block = block * kv_heads + head[:, None]  # [NB, G] row of each head's block
            k_dst = k_cache_ptr + (head_block * HEAD_DIM + dims[None, :]) * BLOCK_SIZE + offset
            tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            v = tl.load(v_ptr + token * stride_vt + head[:, None] * stride_vh + dims[None, :] * stride_vd, mask=mask)
            v_dst = v_cache_ptr + (head_block * BLOCK_SIZE + offset) * HEAD_DIM + dims[None, :]
            tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def rotary_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, Dh], k, v [T, G, Dh] (any strides: views of a fused qkv are read in place), cos, sin [T, Dh]
    (None: no rotary), the layer's cache (contiguous, as kv_cache allocates it) and slot_mapping [T] int64
    (None: no cache) -> (q, k): rotated into new contiguous tensors (fp32 math, the inputs' dtype), or the
    inputs themselves without rotary. The rotated k and v go to the cache at each token's slot
    (block * BS + offset); a slot < 0 is skipped."""
    rotary = cos is not None and sin is not None
    cache = k_cache is not None and v_cache is not None
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if not (rotary or cache) or tokens == 0:
        return q, k
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if rotary else q
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if rotary else k
    block_size = k_cache.shape[-1] if k_cache is not None else 0
    config = rotary_config(head_dim, rotary, block_size)
    q_tiles = triton.cdiv(heads, config["BLOCK_H"]) if rotary else 0
    kv_tiles = triton.cdiv(kv_heads, config["BLOCK_H"])
    if cos is None or sin is None:  # unused pointers: any tensor of the launch's dtype
        cos = sin = q
    else:
        cos, sin = cos.contiguous(), sin.contiguous()
    if k_cache is None or v_cache is None:  # unused pointers
        k_cache = v_cache = k
    else:
        assert slot_mapping is not None and k_cache.is_contiguous() and v_cache.is_contiguous()
    _rotary_write_kernel[(tokens, q_tiles + kv_tiles)](
        q,
        k,
        v,
        q_out,
        k_out,
        cos,
        sin,
        k_cache,
        v_cache,
        slot_mapping if slot_mapping is not None else q,
        heads,
        kv_heads,
        q_tiles,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        cos.stride(0),
        num_warps=NUM_WARPS,
        **config,
    )
    return q_out, k_out


def rotary_config(head_dim: int, rotary: bool, block_size: int) -> dict[str, Any]:
    """The constexprs a launch picks (block_size 0: no cache)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return {
        "ROTARY": rotary,
        "CACHE": block_size > 0,
        "HEAD_DIM": head_dim,
        "BLOCK_SIZE": max(block_size, 1),
        "BLOCK_H": max(1, ROTARY_TILE // block_d),
        "BLOCK_D": block_d,
    }


# ---- ahead-of-time configurations -------------------------------------------------------------------

_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _signature(kernel: Any, types: dict[str, str], constexprs: dict[str, Any]) -> dict[str, str]:
    """Every argument's type: the pointers and floats named, constexprs, and i32 for the rest."""
    return {name: types.get(name, "constexpr" if name in constexprs else "i32") for name in kernel.arg_names}


def _rms_norm_spec(dtype: torch.dtype, block_d: int) -> CompileSpec:
    element = "*" + _TRITON_TYPES[dtype]
    config = {"BLOCK_R": TILE // block_d, "BLOCK_D": block_d}
    types = {"x_ptr": element, "weight_ptr": element, "out_ptr": element, "eps": "fp32"}
    signature = _signature(_rms_norm_kernel, types, config)
    return CompileSpec(f"rms_norm_{_TRITON_TYPES[dtype]}_b{block_d}", _rms_norm_kernel, signature, config, NUM_WARPS)


def _rotary_spec(dtype: torch.dtype, head_dim: int, rotary: bool, cache: bool) -> CompileSpec:
    element = "*" + _TRITON_TYPES[dtype]
    # Inputs with a unit last stride, as views of a fused qkv have: Triton specializes a 1 into a constant.
    config = {**rotary_config(head_dim, rotary, 16 if cache else 0), "stride_qd": 1, "stride_kd": 1, "stride_vd": 1}
    types = {name: element for name in ("q_ptr", "k_ptr", "v_ptr", "q_out_ptr", "k_out_ptr")}
    # Unused pointers are the launch's q or k (rotary_write): the same element type.
    types.update(cos_ptr="*fp32" if rotary else element, sin_ptr="*fp32" if rotary else element)
    types.update(k_cache_ptr=element, v_cache_ptr=element, slot_ptr="*i64" if cache else element)
    signature = _signature(_rotary_write_kernel, types, config)
    mode = "rotary_write" if rotary and cache else "rotary" if rotary else "write"
    name = f"{mode}_{_TRITON_TYPES[dtype]}_d{head_dim}"
    return CompileSpec(name, _rotary_write_kernel, signature, config, NUM_WARPS)


# RMSNorm: every chunk width (D up to 4096 rounded up to a power of two, at least 32; wider D in 4096
# chunks). Rotary and cache write: head dims 64, 128 and the demo models' 32, each of rotary + cache,
# rotary alone (no cache), cache alone (no rotary), with the default 16-key blocks in the activations' dtype.
SM90_SPECS: list[CompileSpec] = [
    _rms_norm_spec(dtype, 1 << bits) for dtype in _TRITON_TYPES for bits in range(5, MAX_BLOCK_D.bit_length())
] + [
    _rotary_spec(dtype, head_dim, rotary, cache)
    for dtype in _TRITON_TYPES
    for head_dim in (32, 64, 128)
    for rotary, cache in ((True, True), (True, False), (False, True))
]
