"""The kernels the model and its sampler call, and only their dispatch: linear, RMSNorm, grammar masks, routing
(top-k with a weighting, the top-p cut), MoE experts, rotary with the cache write, attention (paged or packed)
and latent attention. Each op picks one family: the C++ CPU kernels when they apply (CPU, float32
activations), the Triton kernels on CUDA (moe_serve.kernels.cuda: static shapes, no host sync, so a decode
step can be a CUDA graph), the graph family under the ONNX export's tracer or for a padded batch
(kernels.graph), and the plain-torch twins otherwise (kernels.reference, which the tests also compare every
family with). What the ops take and return is the kernels' vocabulary (kernels.vocabulary); this is the one
module that imports the backends.

Legend: T tokens, S sequences, H query heads, G key/value heads, Dh head dim, E experts, K slots, D hidden,
R router rows, C latent width, NB blocks, BS block size.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch.nn import functional as F

from moe_serve.kernels import cpu_extension, cuda, graph, latent, reference
from moe_serve.kernels.graph import GraphCache, PaddedBatch
from moe_serve.kernels.latent import LatentCache
from moe_serve.kernels.packed import PackedWeight
from moe_serve.kernels.vocabulary import (
    ACTIVATION_IDS,
    LINEAR_MAX_ROWS,
    AttentionBatch,
    ExpertWeights,
    RelativeTerm,
    RouteOutput,
    Weight,
    Weighting,
    float_weight,
    kernel_format,
    kernel_parts,
)


def _cpu_ext(x: torch.Tensor) -> ModuleType | None:
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
            return ext.linear_packed(x, weight.data, weight.scales, kernel_format(weight), bias)
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ext = _cpu_ext(x)
    if ext is not None and weight.dtype == torch.float32:
        return ext.rms_norm(x, weight, eps)
    gpu = _cuda_kernels(x)
    if gpu is not None:
        return gpu.norm.rms_norm(x, weight, eps)
    return reference.rms_norm_torch(x, weight, eps)


def mask_logits(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [R, V] in place: row rows[m] keeps only the tokens whose bit is set in bitmask[m] ([M, W] int32,
    llguidance's layout: bit b of word w is token 32 w + b); the others become -inf (a structured output's
    grammar mask, moe_serve.engine.grammar)."""
    ext = _cpu_ext(logits)
    if ext is not None and logits.is_contiguous():
        ext.mask_logits(logits, rows, bitmask)
        return
    reference.mask_logits_torch(logits, rows, bitmask)


def greedy_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] -> (each row's argmax [R] int64, as torch.argmax; whether every value of the row is
    finite [R] bool): what every step's sampling reads, in one pass over the logits on the CPU."""
    ext = _cpu_ext(logits)
    if ext is not None:
        tokens, finite = ext.greedy_rows(logits)
        return tokens, finite
    return reference.greedy_rows_torch(logits)


# ---- routing ----------------------------------------------------------------------------------------


def topk_route(logits: torch.Tensor, token_k: torch.Tensor, max_k: int, weighting: Weighting) -> RouteOutput:
    """The max_k largest logits per row (ties to the lower index) -> ids [R, K] (-1 beyond a row's k) and
    weights [R, K] by `weighting` (0 beyond a row's k; a row with k = 0, padding in a graph, has none)."""
    ext = _cpu_ext(logits)
    if ext is not None:
        return RouteOutput(*ext.topk_route(logits, token_k, max_k, int(weighting)))
    gpu = _cuda_kernels(logits)
    if gpu is not None and logits.dtype == torch.float32:  # routers compute in fp32; any other: the torch ops
        return gpu.routing.topk_route(logits, token_k, max_k, weighting)
    return reference.topk_route_torch(logits, token_k, max_k, weighting)


def top_p_k(
    logits: torch.Tensor, cut: torch.Tensor, min_k: torch.Tensor, token_k: torch.Tensor, max_k: int
) -> torch.Tensor:
    """Each row's k under top-p: the fewest experts, largest router probability first, whose full-softmax
    probabilities sum (fp32, in that order) to at least cut [R], clamped to [min_k, token_k] -> [R], the dtype
    of token_k (each row's most). A row with cut = inf keeps its token_k. The router's own weighting then
    weighs the k chosen, exactly as for a request with that fixed k. One implementation, in torch ops, on
    every device: sorted values are the same whatever order ties take, so their running sum is too."""
    head = torch.topk(torch.softmax(logits, dim=-1), max_k, dim=-1).values  # [R, K]
    short = (torch.cumsum(head, dim=-1) < cut[:, None]).sum(-1)  # [R] experts before the sum reaches cut
    return torch.minimum(torch.maximum(short + 1, min_k), token_k).to(token_k.dtype)


# ---- MoE experts ------------------------------------------------------------------------------------


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
    return reference.moe_experts_torch(x, topk_ids, topk_weights, bank)


# ---- attention --------------------------------------------------------------------------------------


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
    return reference.rotary_write_torch(q, k, v, rotary, cache, slot_mapping)


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
    return reference.attention_torch(q, k, v, batch, cache, causal, scale, relative, window, chunk, sinks)


def latent_attention(
    q: torch.Tensor,
    latent_rows: torch.Tensor,
    batch: AttentionBatch,
    cache: LatentCache | None,
    rank: int,
    scale: float,
) -> torch.Tensor:
    """Multi-head latent attention in the absorbed form (kernels.latent): q [T, H, C] (each head's query mapped
    into the latent, then its rotated rope part), latent_rows [T, C] this step's rows (already in the cache
    when there is one) -> [T, H, R]. The C++ kernel on the CPU with a float32 cache; plain torch elsewhere."""
    ext = _cpu_ext(q)
    if ext is not None and cache is not None and cache.latent.dtype == torch.float32:
        assert batch.block_tables is not None
        return ext.latent_attention(
            q, cache.latent, batch.block_tables, batch.seq_ids, batch.positions, batch.num_keys, rank, scale
        )
    return latent.latent_attention_torch(q, latent_rows, batch, cache, rank, scale)
