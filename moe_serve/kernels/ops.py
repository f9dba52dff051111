"""The kernels the model calls: linear, MoE experts, attention (paged or packed). Each dispatches to the
C++ CPU kernels when they apply (CPU, float32 activations), to the Triton kernels on CUDA
(moe_serve.kernels.cuda: static shapes, no host sync, so a decode step can be a CUDA graph), and to plain
PyTorch otherwise; the PyTorch versions are also the references the tests compare with.

Legend: T tokens, S sequences, H query heads, G key/value heads, Dh head dim, E experts, K slots,
D hidden, I intermediate, R relative distances, NB blocks, BS block size.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from moe_serve.kernels import cpu_extension, cuda, graph
from moe_serve.kernels.graph import GraphCache, PaddedBatch
from moe_serve.kernels.packed import PackedWeight

LINEAR_MAX_ROWS = 64  # fp32 weights: up to this many rows the C++ kernel (weights streamed once); above, MKL's GEMM

Weight = torch.Tensor | PackedWeight  # a float tensor, or a packed one (bf16, int8, int4: kernels/packed.py)

ACTIVATION_IDS = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3, "swigluoai": 4}


def _cpu_ext(x: torch.Tensor):
    """The C++ kernels when they apply: CPU, float32, and not under the ONNX export's tracer (which
    records plain torch ops only; the graph family, moe_serve.kernels.graph, takes over there)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or torch.jit.is_tracing():
        return None
    return cpu_extension()


def _cuda_kernels(x: torch.Tensor) -> cuda.Kernels | None:
    """The Triton kernels when they apply: CUDA (any dtype), Triton installed, not under a tracer."""
    if x.device.type != "cuda" or torch.jit.is_tracing():
        return None
    return cuda.kernels()


# ---- linear -----------------------------------------------------------------------------------------


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T + bias. A packed or bf16 weight with fp32 x on the CPU takes the C++ kernel
    at every M, so a row's result never depends on its batch: above 4 rows it dequantizes a tile of W rows at
    a time, and on the LM head (32000 x 1024, 2 threads; benchmarks/packed_gemv.py --prefill) it beat
    dequantizing then MKL at every M up to 512 (int4: 26 ms against 287 at M = 64, 243 against 485 at 512),
    and even MKL on an fp32 copy kept beside it (67, 279 ms), which would cost the memory packing saves.
    Elsewhere (CUDA, no extension, the ONNX tracer) the weight is dequantized for torch."""
    ext = _cpu_ext(x)
    if ext is not None and x.dim() == 2:
        if isinstance(weight, PackedWeight):
            return ext.linear_packed(x, weight.data, weight.scales, weight.format.value, bias)
        if weight.dtype == torch.bfloat16 or (weight.dtype == torch.float32 and x.shape[0] <= LINEAR_MAX_ROWS):
            return ext.linear(x, weight, bias)
    return F.linear(x, float_weight(weight, x.dtype), bias)


def head_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y[t, h] = weight[h] @ x[t, h]: x [T, H, K], weight [H, N, K] -> [T, H, N] (latent attention's per-head
    maps). On the CPU the C++ kernel, whose rows do not depend on T, up to LINEAR_MAX_ROWS tokens as `linear`;
    elsewhere a batched matmul."""
    ext = _cpu_ext(x)
    if ext is not None and weight.dtype in (torch.float32, torch.bfloat16) and x.shape[0] <= LINEAR_MAX_ROWS:
        return ext.head_linear(x, weight)
    return torch.einsum("thk,hnk->thn", x, weight.to(x.dtype))


def float_weight(weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    """A weight as a tensor of `dtype` for the torch and CUDA paths: a packed one dequantized (a copy)."""
    return weight.dequantize(dtype) if isinstance(weight, PackedWeight) else weight.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ext = _cpu_ext(x)
    if ext is not None and weight.dtype == torch.float32:
        return ext.rms_norm(x, weight, eps)
    gpu = _cuda_kernels(x)
    if gpu is not None:
        return gpu.norm.rms_norm(x, weight, eps)
    # F.rms_norm is one fused op, but ONNX (opset 17) has no RMSNormalization: traced, it is written out.
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and not torch.jit.is_tracing():
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    x32 = x.float()
    return (weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


# ---- routing ----------------------------------------------------------------------------------------


class Weighting(enum.IntEnum):
    """How a router weighs the experts it chose: softmax over the chosen logits, each chosen expert's
    full-softmax probability (whose sum shrinks with k), or exactly 1/k. A router kind names its weighting
    (moe_serve.layers.routers); the values are the C++ kernel's codes (its `weighting_codes()`)."""

    SOFTMAX_CHOSEN = 0
    SOFTMAX_ALL = 1
    UNIFORM = 2


def topk_route(
    logits: torch.Tensor, token_k: torch.Tensor, max_k: int, weighting: Weighting
) -> tuple[torch.Tensor, torch.Tensor]:
    """The max_k largest logits per row (ties to the lower index) -> ids [R, K] (-1 beyond a row's k) and
    weights [R, K] by `weighting` (0 beyond a row's k; a row with k = 0, padding in a graph, has none)."""
    ext = _cpu_ext(logits)
    if ext is not None:
        ids, weights = ext.topk_route(logits, token_k, max_k, int(weighting))
        return ids, weights
    gpu = _cuda_kernels(logits)
    if gpu is not None and logits.dtype == torch.float32:  # routers compute in fp32; any other: the torch ops
        return gpu.routing.topk_route(logits, token_k, max_k, weighting)
    return topk_route_torch(logits, token_k, max_k, weighting)


def topk_route_torch(
    logits: torch.Tensor, token_k: torch.Tensor, max_k: int, weighting: Weighting
) -> tuple[torch.Tensor, torch.Tensor]:
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
    return topk_ids.masked_fill(~used, -1), weights


def top_p_k(
    logits: torch.Tensor, cut: torch.Tensor, min_k: torch.Tensor, top_k: torch.Tensor, max_k: int
) -> torch.Tensor:
    """Each row's k under top-p: the fewest experts, largest router probability first, whose full-softmax
    probabilities sum (fp32, in that order) to at least cut [R], clamped to [min_k, top_k] -> [R], the dtype
    of top_k. A row with cut = inf keeps top_k. The router's own mode then weighs the k chosen, exactly
    as for a request with that fixed k."""
    # Sorted values are the same whatever order ties take, so their running sum is too.
    head = torch.topk(torch.softmax(logits, dim=-1), max_k, dim=-1).values  # [R, K]
    short = (torch.cumsum(head, dim=-1) < cut[:, None]).sum(-1)  # [R] experts before the sum reaches cut
    return torch.minimum(torch.maximum(short + 1, min_k), top_k).to(top_k.dtype)


# ---- MoE experts ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """One expert bank as the kernel sees it: y = act(x w1^T + b1) [* (x w3^T + b3)] w2^T + b2."""

    w1: Weight  # [E, I, D]
    w2: Weight  # [E, D, I]
    activation: str
    b1: torch.Tensor | None = None  # [E, I]
    w3: Weight | None = None  # [E, I, D], gated experts (GLU), in w1's format
    b3: torch.Tensor | None = None
    b2: torch.Tensor | None = None  # [E, D]
    swiglu: SwiGLUClamp | None = None  # activation "swigluoai" only

    @property
    def packed(self) -> bool:
        return any(isinstance(w, PackedWeight) for w in (self.w1, self.w2, self.w3))

    def dequantized(self, dtype: torch.dtype) -> ExpertWeights:
        """The bank with its weights as tensors of `dtype` (the CUDA path; packed ones dequantized: a copy)."""
        w3 = float_weight(self.w3, dtype) if self.w3 is not None else None
        return dataclasses.replace(self, w1=float_weight(self.w1, dtype), w2=float_weight(self.w2, dtype), w3=w3)


def moe_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, bank: ExpertWeights
) -> torch.Tensor:
    """x [T, D], topk_ids [T, K] (-1: slot unused), topk_weights [T, K] fp32 -> [T, D]: the weighted sum of
    each token's experts, combined in slot order."""
    if torch.jit.is_tracing():  # the ONNX export: shapes that follow the routing, no host sync
        assert not bank.packed, "the ONNX export takes float weights only (it refuses quantized artifacts)"
        return graph.moe_experts(x, topk_ids, topk_weights, bank)
    ext = _cpu_ext(x)
    formats = [kernel_format(w) for w in (bank.w1, bank.w2)]
    if ext is not None and None not in formats:
        return ext.moe_experts_packed(
            x,
            topk_ids,
            topk_weights,
            formats[0],
            *kernel_parts(bank.w1),
            bank.b1,
            *(kernel_parts(bank.w3) if bank.w3 is not None else (None, None)),
            bank.b3,
            formats[1],
            *kernel_parts(bank.w2),
            bank.b2,
            ACTIVATION_IDS[bank.activation],
            *((bank.swiglu.alpha, bank.swiglu.limit) if bank.swiglu is not None else (0.0, 0.0)),
        )
    gpu = _cuda_kernels(x)
    if gpu is not None and bank.swiglu is None:  # the GPU kernels have no clamped SwiGLU: the torch path
        return gpu.moe.moe_experts(x, topk_ids, topk_weights, bank.dequantized(x.dtype) if bank.packed else bank)
    return moe_experts_torch(x, topk_ids, topk_weights, bank)


def kernel_format(weight: Weight) -> str | None:
    """The C++ kernels' name of a weight's format (packed.WeightFormat's values); None: they have none."""
    if isinstance(weight, PackedWeight):
        return weight.format.value
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(weight.dtype)


def kernel_parts(weight: Weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(data, scales) as the C++ kernels take a weight."""
    return (weight.data, weight.scales) if isinstance(weight, PackedWeight) else (weight, None)


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


def row_invariant(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """fn computed in float64 on the CPU and rounded back to the input's dtype. ATen's CPU loops for sigmoid,
    silu, tanh-gelu and log1p take a vectorised or a scalar path by the tensor's size, and the two differ in
    the last bit, so a token's result moved with its batch (silu: a row among 9 rows of 4 against the row
    alone); in float64 both paths are far below the rounding. relu, erf-gelu, exp and softmax need none of
    this (tested: tests/unit/test_row_invariance.py). Other devices compute every element alike, and the ONNX
    tracer records the plain op."""

    def wrapped(x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or torch.jit.is_tracing() or x.dtype == torch.float64:
            return fn(x)
        return fn(x.double()).to(x.dtype)

    return wrapped


sigmoid = row_invariant(torch.sigmoid)
log1p = row_invariant(torch.log1p)

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": row_invariant(lambda v: F.gelu(v, approximate="tanh")),
    "silu": row_invariant(F.silu),
}


@dataclass(frozen=True, slots=True)
class SwiGLUClamp:
    """gpt-oss's gated unit ("swigluoai", vLLM's name): g = min(gate, limit), u = clamp(up, -limit, limit),
    g * sigmoid(alpha g) * (u + 1). Defined on the pair only: a GLU activation, never a plain one."""

    alpha: float
    limit: float


def glu(activation: str, gate: torch.Tensor, up: torch.Tensor, swiglu: SwiGLUClamp | None = None) -> torch.Tensor:
    """A gated unit's output from its two projections: act(gate) * up, or the clamped SwiGLU."""
    if activation == "swigluoai":
        assert swiglu is not None, "the clamped SwiGLU needs its alpha and limit"
        g = gate.clamp(max=swiglu.limit)
        return g * sigmoid(g * swiglu.alpha) * (up.clamp(-swiglu.limit, swiglu.limit) + 1)
    return ACTIVATIONS[activation](gate) * up


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


# ---- attention --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RelativeTerm:
    """Transformer-XL's positional term for query i and key j: (q + r_r_bias) . r_k[i - j + offset]."""

    q_rel: torch.Tensor  # [T, H, Dh] = q + r_r_bias
    r_k: torch.Tensor  # [R, H, Dh] the projected sinusoid of each distance
    r_kt: torch.Tensor  # [H, Dh, R] the same, laid out for the C++ kernel
    offset: int


@dataclass(frozen=True, slots=True)
class AttentionBatch:
    """Where each query token's keys are. Built once per step by the runner, shared by every layer."""

    seq_ids: torch.Tensor  # [T] int64, the sequence of each query token (0..S-1)
    positions: torch.Tensor  # [T] int64, its position in that sequence
    num_keys: torch.Tensor  # [S] int64, keys each sequence has once this step's tokens are in
    seq_starts: torch.Tensor  # [S] int64, the sequence's first row in the packed batch
    seq_lens: tuple[int, ...]  # host: query tokens of each sequence in this step
    num_keys_host: tuple[int, ...]  # host copy of num_keys
    block_tables: torch.Tensor | None = None  # [S, max_blocks] int32; None: keys are the batch's own tokens
    slot_mapping: torch.Tensor | None = None  # [T] int64, cache row (block * BS + offset) of each token


# The paged cache, per layer: keys [NB, G, Dh, BS] (transposed inside each block, so 16 keys' scores are one
# vector), values [NB, G, BS, Dh].


def cache_shapes(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (num_blocks, num_kv_heads, head_dim, block_size), (num_blocks, num_kv_heads, block_size, head_dim)


def rotary_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    cache: tuple[torch.Tensor, torch.Tensor] | GraphCache | None,
    batch: AttentionBatch | PaddedBatch | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q [T, H, Dh] and k [T, G, Dh] (cos, sin [T, Dh]), and k, v stored at their cache
    slots (batch.slot_mapping; no batch: no cache, as in the vLLM plugin, whose attention owns it) -> (q, k)
    rotated."""
    if isinstance(batch, PaddedBatch):
        assert not isinstance(cache, tuple)
        return graph.rotary_write(q, k, v, rotary, cache, batch)
    assert not isinstance(cache, GraphCache)
    slot_mapping = batch.slot_mapping if batch is not None else None
    ext = _cpu_ext(q)
    if ext is not None and (cache is None or cache[0].dtype == torch.float32):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        cos, sin = rotary if rotary is not None else (None, None)
        k_cache, v_cache = cache if cache is not None else (None, None)
        ext.rotary_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
        return q, k
    gpu = _cuda_kernels(q)
    if gpu is not None:
        cos, sin = rotary if rotary is not None else (None, None)
        k_cache, v_cache = cache if cache is not None else (None, None)
        return gpu.norm.rotary_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    if rotary is not None:
        from moe_serve.layers.positions import apply_rotary

        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
    if cache is not None:
        k_cache, v_cache = cache
        block_size = k_cache.shape[-1]
        assert slot_mapping is not None
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        k_cache[blocks, :, :, offsets] = k.to(k_cache.dtype)
        v_cache[blocks, :, offsets, :] = v.to(v_cache.dtype)
    return q, k


def attention(
    q: torch.Tensor,  # [T, H, Dh]
    k: torch.Tensor,  # [T, G, Dh] this step's keys (already in the cache when there is one)
    v: torch.Tensor,
    batch: AttentionBatch | PaddedBatch,
    cache: tuple[torch.Tensor, torch.Tensor] | GraphCache | None,
    causal: bool,
    scale: float,
    relative: RelativeTerm | None = None,
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale [+ relative]) v over each query's visible keys of its own sequence -> [T, H, Dh].

    window: a causal sliding window, each query seeing its last `window` keys (itself included). chunk:
    causal local chunks, each query seeing the keys of its own chunk of `chunk` positions (Llama 4). sinks
    [H]: a learned logit per query head in the softmax's denominator, with no value (gpt-oss)."""
    spans = window is not None or chunk is not None
    if isinstance(batch, PaddedBatch):
        assert not isinstance(cache, tuple)
        if spans or sinks is not None:  # models with these are refused before a graph is built
            raise NotImplementedError("padded-graph attention has no windows, local chunks or attention sinks")
        return graph.attention(q, k, v, batch, cache, causal, scale, relative)
    assert not isinstance(cache, GraphCache)
    if spans and not causal:
        raise ValueError("a sliding window or local chunks need causal attention")
    ext = _cpu_ext(q)
    rel = (relative.q_rel, relative.r_kt, relative.offset) if relative is not None else (None, None, 0)
    shape = (window or 0, chunk or 0, sinks)
    if ext is not None and (cache is None or (cache[0].dtype == torch.float32 and cache[0].shape[-1] % 16 == 0)):
        if cache is not None:
            return ext.paged_attention(
                q,
                cache[0],
                cache[1],
                batch.block_tables,
                batch.seq_ids,
                batch.positions,
                batch.num_keys,
                causal,
                scale,
                *rel,
                *shape,
            )
        return ext.packed_attention(
            q, k, v, batch.seq_starts, batch.seq_ids, batch.positions, batch.num_keys, causal, scale, *rel, *shape
        )
    gpu = _cuda_kernels(q)
    if spans or sinks is not None:  # the GPU kernels have none of these: the torch path below
        gpu = None
    if gpu is not None and relative is None:  # Transformer-XL's positional term: the torch path below
        if cache is not None:
            assert batch.block_tables is not None
            return gpu.attention.paged_attention(
                q,
                cache[0],
                cache[1],
                batch.block_tables,
                batch.seq_ids,
                batch.positions,
                batch.num_keys,
                causal,
                scale,
                seq_starts=batch.seq_starts,
            )
        return gpu.attention.packed_attention(
            q, k, v, batch.seq_starts, batch.seq_ids, batch.positions, batch.num_keys, causal, scale
        )
    return attention_torch(q, k, v, batch, cache, causal, scale, relative, window, chunk, sinks)


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


def gather_sequence(
    cache: tuple[torch.Tensor, torch.Tensor], block_table: torch.Tensor, num_keys: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's first num_keys cached keys and values, in order: [num_keys, G, Dh] each."""
    k_cache, v_cache = cache
    blocks = block_table[: -(-num_keys // k_cache.shape[-1])].long()
    keys = k_cache[blocks].permute(0, 3, 1, 2).reshape(-1, *k_cache.shape[1:3])[:num_keys]
    values = v_cache[blocks].permute(0, 2, 1, 3).reshape(-1, v_cache.shape[1], v_cache.shape[3])[:num_keys]
    return keys, values


# ---- per-sequence ops (routers that decide once per input): packed here, padded in kernels.graph -----


def sequence_means(x: torch.Tensor, batch: AttentionBatch | PaddedBatch) -> torch.Tensor:
    """x [T, D] -> each sequence's mean token [S, D] fp32."""
    if isinstance(batch, PaddedBatch):
        return graph.sequence_means(x, batch)
    return torch.stack([part.float().mean(0) for part in x.split(batch.seq_lens)])


def sequence_lengths(batch: AttentionBatch | PaddedBatch) -> torch.Tensor:
    """[S] tokens of each sequence in the step."""
    if isinstance(batch, PaddedBatch):
        return graph.sequence_lengths(batch)
    return torch.tensor(batch.seq_lens, device=batch.positions.device)


def to_tokens(values: torch.Tensor, batch: AttentionBatch | PaddedBatch) -> torch.Tensor:
    """values [S, ...] -> [T, ...]: each sequence's value for each of its tokens."""
    if isinstance(batch, PaddedBatch):
        return graph.to_tokens(values, batch)
    return values.repeat_interleave(sequence_lengths(batch), dim=0)


def merge(
    weights: torch.Tensor, ids: torch.Tensor, param: torch.Tensor, batch: AttentionBatch | PaddedBatch
) -> torch.Tensor:
    """weights [S, K], ids [S, K] (clamped: an unused slot has weight 0), param [E, ...] -> [S, ...]: each
    sequence's weighted average of its chosen experts' parameter (SMEAR's merge). One sequence at a time in
    the engine, so a sequence's merge never depends on its batch."""
    if isinstance(batch, PaddedBatch):
        return graph.merge(weights, ids, param, batch)
    merged = [torch.einsum("k,k...->...", w.to(param.dtype), param[i]) for w, i in zip(weights, ids, strict=True)]
    return torch.stack(merged)


def sequence_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, batch: AttentionBatch | PaddedBatch
) -> torch.Tensor:
    """x [T, in], weight [S, out, in], bias [S, out] -> [T, out]: each sequence's tokens through its own map."""
    if isinstance(batch, PaddedBatch):
        return graph.sequence_linear(x, weight, bias, batch)
    parts = x.split(batch.seq_lens)
    return torch.cat([linear(part, weight[s], None if bias is None else bias[s]) for s, part in enumerate(parts)])
