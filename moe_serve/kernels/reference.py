"""The plain-torch twins of the kernels' ops: what ops.py runs where no compiled kernel applies (CUDA without
Triton, dtypes the kernels lack, MOE_SERVE_KERNELS=torch, features a kernel family does not have), and the
obviously correct references the kernel tests compare with. Each is written for clarity over speed: one
sequence at a time where that is simplest, a stable sort for ties, fp32 for every reduction.

Legend: T tokens, S sequences, H query heads, G key/value heads, Dh head dim, E experts, K slots, D hidden,
R router rows (or relative distances), NB blocks, BS block size.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from moe_serve.kernels.packed import GROUP_SIZE, PackedWeight, integer_values, untile
from moe_serve.kernels.rotary import apply_rotary
from moe_serve.kernels.vocabulary import (
    ACTIVATIONS,
    AttentionBatch,
    ExpertWeights,
    RelativeTerm,
    RouteOutput,
    Weight,
    Weighting,
    float_weight,
    gather_sequence,
    glu,
)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # F.rms_norm is one fused op, but ONNX (opset 17) has no RMSNormalization: traced, it is written out.
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and not torch.jit.is_tracing():
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    x32 = x.float()
    return (weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def rotary_write_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    cache: tuple[torch.Tensor, torch.Tensor] | None,
    slot_mapping: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.rotary_write: rotary on q and k, then k and v stored at their cache rows (block * BS + offset)."""
    if rotary is not None:
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
    if cache is not None:
        k_cache, v_cache = cache
        block_size = k_cache.shape[-1]
        assert slot_mapping is not None
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        k_cache[blocks, :, :, offsets] = k.to(k_cache.dtype)
        v_cache[blocks, :, offsets, :] = v.to(v_cache.dtype)
    return q, k


def topk_route_torch(logits: torch.Tensor, token_k: torch.Tensor, max_k: int, weighting: Weighting) -> RouteOutput:
    """ops.topk_route in torch ops."""
    if torch.jit.is_tracing():  # ONNX has no stable sort; its TopK puts ties at the lower index too
        topk_logits, topk_ids = torch.topk(logits, max_k, dim=-1)
    else:  # a stable sort puts ties in index order
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        topk_logits, topk_ids = sorted_logits[:, :max_k], order[:, :max_k]  # [R, K]
    used = torch.arange(max_k, device=logits.device)[None, :] < token_k[:, None]  # [R, K]
    if weighting is Weighting.UNIFORM:
        weights = used.float() / token_k.clamp(min=1)[:, None].float()
    elif weighting is Weighting.SOFTMAX_ALL:
        weights = torch.softmax(logits, dim=-1).gather(1, topk_ids) * used
    else:
        weights = torch.softmax(topk_logits.masked_fill(~used, float("-inf")), dim=-1)
        weights = torch.where(used, weights, torch.zeros_like(weights))  # a k = 0 row is all -inf: NaN
    return RouteOutput(topk_ids.masked_fill(~used, -1), weights)


def moe_experts_torch(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, bank: ExpertWeights
) -> torch.Tensor:
    """Slots grouped by expert, each expert once on its slice (grouped GEMM), combined in slot order."""
    t, k = topk_ids.shape
    used = topk_ids >= 0  # [T, K]
    slot_expert = topk_ids[used]  # [S]
    slot_token = torch.arange(t, device=x.device)[:, None].expand(t, k)[used]  # [S]
    order = torch.argsort(slot_expert, stable=True)  # [S] slots sorted by expert
    sorted_expert = slot_expert[order]
    offsets = torch.cumsum(torch.bincount(slot_expert, minlength=bank.w1.shape[0]), 0).to(torch.int32)  # [E]
    xs = x[slot_token[order]]  # [S, D]

    def grouped(w: Weight, b: torch.Tensor | None, h: torch.Tensor) -> torch.Tensor:
        out = _grouped_mm(h, float_weight(w, h.dtype), offsets)
        return out if b is None else out + b[sorted_expert]

    first = grouped(bank.w1, bank.b1, xs)
    if bank.w3 is not None:
        h = glu(bank.activation, first, grouped(bank.w3, bank.b3, xs), bank.swiglu)
    else:
        h = ACTIVATIONS[bank.activation](first)
    sorted_out = grouped(bank.w2, bank.b2, h)  # [S, D]
    slot_out = torch.empty_like(sorted_out)
    slot_out[order] = sorted_out
    per_slot = x.new_zeros(t, k, x.shape[-1])  # [T, K, D]
    per_slot[used] = slot_out
    # Combine in slot order with fixed weights: no atomics, so a token's sum is batch-independent.
    return (per_slot.float() * topk_weights[..., None]).sum(1).to(x.dtype)


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [S, in] sorted by expert, weight [E, out, in], offsets [E] group ends -> [S, out]."""
    grouped_mm = getattr(F, "grouped_mm", None)  # torch >= 2.9
    # It takes rows whose strides are multiples of 16 bytes only (an adapter of 6 units, say, is not).
    aligned = all(n * x.element_size() % 16 == 0 for n in weight.shape[1:])
    if grouped_mm is not None and aligned and (x.device.type == "cpu" or x.dtype == torch.bfloat16):
        return grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    # Older torch, unaligned rows, or CUDA in fp32/fp16 (its grouped GEMM takes bf16): pad groups to the
    # largest, one bmm.
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).long()  # [E]
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts)  # [S]
    row_in_group = torch.arange(x.shape[0], device=x.device) - (offsets.long() - counts)[expert_of_row]
    capacity = int(counts.max()) if x.shape[0] else 0
    padded = x.new_zeros(len(counts), capacity, x.shape[1])  # [E, C, in]
    padded[expert_of_row, row_in_group] = x
    out = torch.bmm(padded, weight.transpose(1, 2))  # [E, C, out]
    return out[expert_of_row, row_in_group]


def attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: AttentionBatch,
    cache: tuple[torch.Tensor, torch.Tensor] | None,
    causal: bool,
    scale: float,
    relative: RelativeTerm | None = None,
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence at a time: gather its keys (from its blocks, or its own rows), mask by position, SDPA
    (with sinks, the softmax written out: SDPA has no extra denominator term)."""
    out = torch.empty_like(q)
    start = 0
    for s, n in enumerate(batch.seq_lens):
        rows = slice(start, start + n)
        start += n
        num_keys = batch.num_keys_host[s]
        if cache is None:
            first = int(batch.seq_starts[s])
            keys, values = k[first : first + num_keys], v[first : first + num_keys]  # [S_k, G, Dh]
        else:
            keys, values = gather_sequence(cache, batch.block_tables[s], num_keys)  # type: ignore[index]
        query_pos = batch.positions[rows]  # [n]
        lo = 0  # keys before every query's window or chunk are not read (their blocks may be gone)
        if window is not None:
            lo = max(lo, int(query_pos.min()) - window + 1)
        if chunk is not None:
            lo = max(lo, int(query_pos.min()) // chunk * chunk)
        keys, values = keys[lo:], values[lo:]
        key_pos = torch.arange(lo, num_keys, device=q.device)
        allowed = (
            key_pos[None, :] <= query_pos[:, None]
            if causal
            else torch.ones(n, num_keys, dtype=torch.bool, device=q.device)
        )
        if window is not None:
            allowed &= key_pos[None, :] > query_pos[:, None] - window
        if chunk is not None:
            allowed &= key_pos[None, :] // chunk == query_pos[:, None] // chunk
        mask = torch.zeros(allowed.shape, device=q.device, dtype=torch.float32).masked_fill(~allowed, float("-inf"))
        qs = q[rows].transpose(0, 1)  # [H, n, Dh]
        if relative is not None:
            distance = query_pos[:, None] - key_pos[None, :] + relative.offset  # [n, S_k]
            r_rows = relative.r_k[distance.clamp(0, relative.r_k.shape[0] - 1)]  # [n, S_k, H, Dh]
            positional = torch.einsum("nhd,nshd->hns", relative.q_rel[rows].float(), r_rows.float())
            mask = mask[None] + positional * scale  # [H, n, S_k]
        if sinks is not None:
            out[rows] = _attention_with_sinks(qs, keys, values, mask, scale, sinks).transpose(0, 1)
            continue
        o = F.scaled_dot_product_attention(
            qs,
            keys.transpose(0, 1).to(q.dtype),
            values.transpose(0, 1).to(q.dtype),
            attn_mask=mask.to(q.dtype),
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = o.transpose(0, 1)
    return out


def _attention_with_sinks(
    qs: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """qs [H, n, Dh], keys/values [S_k, G, Dh], mask [n, S_k] -> [H, n, Dh]: softmax over the scores and, per
    head, the sink logit (not scaled; it weights no value), in fp32."""
    h = qs.shape[0]
    group = h // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S_k, Dh]
    v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qs.float(), k.transpose(1, 2)) * scale + mask  # [H, n, S_k]
    sink = sinks.float()[:, None, None].expand(h, scores.shape[1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v).to(qs.dtype)


def mask_logits_torch(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [R, V] in place: row rows[m] keeps the tokens whose bit is set in bitmask[m] ([M, W] int32, bit
    b of word w is token 32 w + b) and the others become -inf."""
    allowed = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=bitmask.device)) & 1
    allowed = allowed.view(bitmask.shape[0], -1)[:, : logits.shape[1]].bool()
    logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))


def greedy_rows_torch(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] -> (each row's argmax [R] int64, whether every value of the row is finite [R] bool)."""
    return logits.argmax(dim=-1), torch.isfinite(logits).all(dim=-1)


# ---- int8 activations (kernels/csrc/int_dot.h) ------------------------------------------------------


def quantize_activations_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (q int8 [M, K], d fp32 [M, K / 32], s int32 [M, K / 32]): per row and block of 32
    values, d = max|x| / 127, q = round_half_even(x * (1 / d)) (d = 0 and q = 0 where max|x| < 2^-120, whose
    1 / d would overflow), s the block's sum of q. The definition the C++ quantizer is tested against, bit
    for bit (finite x)."""
    M, K = x.shape
    blocks = x.float().reshape(M, K // GROUP_SIZE, GROUP_SIZE)
    amax = blocks.abs().amax(-1)
    d = torch.where(amax >= 2.0**-120, amax / 127.0, torch.zeros_like(amax))
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(M, K), d, q.sum(-1, dtype=torch.int32)


def int8_linear_torch(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) with int8 activations, as the integer kernels compute it: x
    quantized (quantize_activations_torch), each block's integer dot product exact (float64 holds it), and per
    output the fp32 sum over blocks in order of (d_w * d_x) * sum, each operation rounded."""
    weight = untile(weight)
    assert weight.format.grouped and weight.scales is not None
    q, d, _ = quantize_activations_torch(x)
    values = integer_values(weight)  # [N, K]
    w_scales = weight.scales.float()  # [N, B]
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for b in range(w_scales.shape[1]):
        cols = slice(b * GROUP_SIZE, (b + 1) * GROUP_SIZE)
        sums = (q[:, cols].double() @ values[:, cols].double().T).float()  # exact: |sum| < 2^24
        acc = acc + (w_scales[None, :, b] * d[:, b, None]) * sums
    return acc + bias.float() if bias is not None else acc


# ---- bf16 activations (kernels/csrc/bf16_dot.h) -----------------------------------------------------

_FP32_TINY = 2.0**-126  # the smallest normal float32: vdpbf16ps reads bf16 below it as 0 and flushes results


def _flush(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t.abs() < _FP32_TINY, t * 0, t)  # keeps the sign, as the hardware's flush does


def bf16_linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ weight [N, K]^T bf16 (+ bias) with bf16 activations, as vdpbf16ps computes it: x rounded
    to bf16 (PyTorch's rule), bf16 subnormals read as 0, and per output one 16-lane fp32 accumulator over
    chunks of 32 values, lane j adding value 2j + 1's product then 2j's (each exact in fp32, each sum rounded
    and flushed), chunk after chunk; then the lanes (j + 8), + 4, + 2, + 1. Bit for bit the kernel's where
    every product lies in float32's normal range."""
    M, K = x.shape
    N = weight.shape[0]
    xs = _flush(x.to(torch.bfloat16).float()).reshape(M, 1, K // 32, 16, 2)
    ws = _flush(weight.float()).reshape(1, N, K // 32, 16, 2)
    acc = torch.zeros(M, N, 16)
    for c in range(K // 32):
        for half in (1, 0):
            acc = _flush(acc + xs[:, :, c, :, half] * ws[:, :, c, :, half])
    acc = acc[..., :8] + acc[..., 8:]
    acc = acc[..., :4] + acc[..., 4:]
    acc = acc[..., :2] + acc[..., 2:]
    out = acc[..., 0] + acc[..., 1]
    return out + bias.float() if bias is not None else out
