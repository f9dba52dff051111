"""The kernels' shared vocabulary: the operands every kernel family takes (weights, expert banks, the step's
attention batch, the Transformer-XL term), the routing weightings and their result, and the activations.
Every backend (the C++ kernels, the Triton kernels, the graph family, the plain-torch references) and the
dispatcher (ops.py) import these names from here; this module imports no backend.

Legend: T tokens, S sequences, H query heads, G key/value heads, Dh head dim, E experts, K slots, D hidden,
I intermediate, R relative distances (or router rows), N experts a router scores, NB blocks, BS block size.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.nn import functional as F

from moe_serve.kernels.packed import PackedWeight

# fp32 weights: up to this many rows the C++ kernel (weights streamed once); above, MKL's GEMM, whose blocking
# follows the row count (docs/architecture.md §6: the bound on bitwise batch invariance).
LINEAR_MAX_ROWS = 64

Weight = torch.Tensor | PackedWeight  # a float tensor, or a packed one (bf16, int8, int4: kernels/packed.py)


def float_weight(weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    """A weight as a tensor of `dtype` for the torch and CUDA paths: a packed one dequantized (a copy)."""
    return weight.dequantize(dtype) if isinstance(weight, PackedWeight) else weight.to(dtype)


def kernel_format(weight: Weight) -> str | None:
    """The C++ kernels' name of a weight's format (packed.WeightFormat's values, and "/int8" after int8 or int4
    where the kernels quantize its input activations, "/int8-tiled" where its data is in tiles of 8 rows too,
    "/bf16" after bf16 where they round them to bf16: formats.h's KernelFormat); None: they have none."""
    if isinstance(weight, PackedWeight):
        if weight.activations == "fp32":
            return weight.format.value
        if weight.activations == "bf16":
            return weight.format.value + "/bf16"
        return weight.format.value + ("/int8-tiled" if weight.tiled else "/int8")
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(weight.dtype)


def kernel_parts(weight: Weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(data, scales) as the C++ kernels take a weight."""
    return (weight.data, weight.scales) if isinstance(weight, PackedWeight) else (weight, None)


# ---- routing ----------------------------------------------------------------------------------------


class Weighting(enum.IntEnum):
    """How a router weighs the experts it chose: softmax over the chosen logits, each chosen expert's
    full-softmax probability (whose sum shrinks with k), or exactly 1/k. A router kind names its weighting
    (moe_serve.layers.routers); the values are the codes the C++ and Triton kernels take (the C++
    `weighting_codes()`)."""

    SOFTMAX_CHOSEN = 0
    SOFTMAX_ALL = 1
    UNIFORM = 2


class RouteOutput(NamedTuple):
    """What routing hands the experts: per row, its chosen experts in slot order and their combine weights.
    Slots beyond a row's own k (token_k) hold id -1 and weight 0 and are never computed."""

    topk_ids: torch.Tensor  # [R, K] int64
    topk_weights: torch.Tensor  # [R, K] fp32


# ---- activations ------------------------------------------------------------------------------------

ACTIVATION_IDS = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3, "swigluoai": 4}  # the C++ and Triton codes


def row_invariant(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """fn computed in float64 on the CPU and rounded back to the input's dtype. ATen's CPU loops for sigmoid,
    silu, tanh-gelu and log1p take a vectorised or a scalar path by the tensor's size, and the two differ in
    the last bit, so a token's result moved with its batch (silu: a row among 9 rows of 4 against the row
    alone; erf-gelu in bfloat16 on an AVX2 machine, though not with AVX-512: row 15 of 17 rows of 4); in
    float64 both paths are far below the rounding. relu, exp and softmax need none of this (tested:
    tests/unit/kernels/test_row_invariance.py, on every machine the tests run on). Other devices compute
    every element alike, and the ONNX tracer records the plain op."""

    def wrapped(x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or torch.jit.is_tracing() or x.dtype == torch.float64:
            return fn(x)
        return fn(x.double()).to(x.dtype)

    return wrapped


sigmoid = row_invariant(torch.sigmoid)
log1p = row_invariant(torch.log1p)

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": row_invariant(F.gelu),
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


def gather_sequence(
    cache: tuple[torch.Tensor, torch.Tensor], block_table: torch.Tensor, num_keys: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's first num_keys cached keys and values, in order: [num_keys, G, Dh] each."""
    k_cache, v_cache = cache
    blocks = block_table[: -(-num_keys // k_cache.shape[-1])].long()
    keys = k_cache[blocks].permute(0, 3, 1, 2).reshape(-1, *k_cache.shape[1:3])[:num_keys]
    values = v_cache[blocks].permute(0, 2, 1, 3).reshape(-1, v_cache.shape[1], v_cache.shape[3])[:num_keys]
    return keys, values
