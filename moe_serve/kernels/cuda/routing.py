"""Routing as two Triton kernels: ops.topk_route and the MoE slots' alignment (static_moe.align) for CUDA tensors.

Why: a decode step at batch 1 is hundreds of tiny kernels, and on an H100 every one costs a microsecond or
two of a CUDA graph's time whatever its work. The profile of the large benchmark model (docs/gpu.md) put
about 35 of the ~50 kernels of a layer in the routing's plain-torch ops: the top-k (a sort, masks, a
softmax) and the alignment (a histogram, two cumulative sums, a stable sort, scatters, a search). Here
each is one launch (the alignment, two fills and one launch).

1. `topk_route`: one program per row. The top max_k by repeated arg-max (the lowest index among equal
   values, NaN first, as torch's stable descending sort), then the weights by the kind's weighting. Per
   row, so a row's result never depends on the others.
2. `align`: for slot counts up to ALIGN_MAX_SLOTS (decode steps and short prefills), one program per
   expert: each histograms all the slots' experts (every program the same counts), takes its group's first
   row from the padded counts before it, and writes its slots in slot order (the rank is a running count
   of its own slots). Longer steps take static_moe.align. Both give the same integers: the alignment
   decides only where a slot's row is computed, never a value.

Legend: R rows, E experts, K the artifact's max k, S = R * K slots, BM rows per block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_serve.kernels.cuda.common import CompileSpec
from moe_serve.kernels.static_moe import Alignment, capacity
from moe_serve.kernels.static_moe import align as align_torch
from moe_serve.kernels.vocabulary import RouteOutput, Weighting

# Above this many slots the alignment takes the torch ops: every program of the kernel holds all the
# slots' experts in registers (4096 int32 over 4 warps: 32 a thread).
ALIGN_MAX_SLOTS = 4096


@triton.jit
def _topk_route_kernel(
    logits_ptr,  # [R, E] fp32
    token_k_ptr,  # [R] int64
    ids_ptr,  # [R, K] int64 out, -1 beyond the row's k
    weights_ptr,  # [R, K] fp32 out, 0 beyond the row's k
    E: tl.constexpr,
    K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WEIGHTING: tl.constexpr,  # vocabulary.Weighting: 0 softmax of the chosen, 1 full softmax, 2 uniform
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    v = tl.load(logits_ptr + row * E + cols, mask=cols < E, other=float("-inf"))
    k = tl.load(token_k_ptr + row)
    slots = tl.arange(0, BLOCK_K)
    nan = v != v
    taken = cols >= E  # padding columns are never chosen
    chosen_ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    chosen = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for j in tl.static_range(K):
        free = taken == 0
        # torch's descending sort puts NaN first; among equal values the lowest index (a stable sort)
        first_nan = tl.min(tl.where(free & nan, cols, BLOCK_E))
        top = tl.max(tl.where(free & (nan == 0), v, float("-inf")))
        first_top = tl.min(tl.where(free & (nan == 0) & (v == top), cols, BLOCK_E))
        pick = tl.where(first_nan < BLOCK_E, first_nan, first_top)
        value = tl.sum(tl.where(cols == pick, v, 0.0))
        chosen_ids = tl.where(slots == j, pick, chosen_ids)
        chosen = tl.where(slots == j, value, chosen)
        taken = taken | (cols == pick)
    used = slots < k
    if WEIGHTING == 0:  # softmax over the chosen logits within the row's k
        peak = tl.max(tl.where(used, chosen, float("-inf")))
        e = tl.where(used, tl.exp(chosen - tl.where(k > 0, peak, 0.0)), 0.0)
        total = tl.where(k > 0, tl.sum(e), 1.0)  # a k = 0 row (a graph's padding) has no weights to divide
        weights = tl.where(used, tl.math.div_rn(e, total), 0.0)
    elif WEIGHTING == 1:  # each chosen expert's probability under the full softmax
        peak = tl.max(tl.where(cols < E, v, float("-inf")))
        total = tl.sum(tl.where(cols < E, tl.exp(v - peak), 0.0))
        weights = tl.where(used, tl.math.div_rn(tl.exp(chosen - peak), total), 0.0)
    else:
        weights = tl.where(used, tl.math.div_rn(1.0, tl.maximum(k, 1).to(tl.float32)), 0.0)
    out = row * K + slots
    tl.store(ids_ptr + out, tl.where(used, chosen_ids.to(tl.int64), -1), mask=slots < K)
    tl.store(weights_ptr + out, weights, mask=slots < K)


@triton.jit(do_not_specialize=["num_slots"])
def _align_kernel(
    ids_ptr,  # [S] int64, -1: no expert
    sorted_slots_ptr,  # [C] int32, filled with S beforehand (padding rows)
    block_expert_ptr,  # [NB] int32, filled with -1 beforehand (blocks past the last group)
    num_slots,
    E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,  # a power of two >= num_slots
    NUM_BINS: tl.constexpr,  # a power of two >= E + 2: the experts, no expert (E), past the slots (E + 1)
    BLOCK_B: tl.constexpr,  # a power of two >= the blocks one group can span
):
    expert = tl.program_id(0)
    slots = tl.arange(0, BLOCK_S)
    ids = tl.load(ids_ptr + slots, mask=slots < num_slots, other=E + 1)
    key = tl.where(ids >= 0, ids, E).to(tl.int32)
    key = tl.where(slots < num_slots, key, E + 1)
    counts = tl.histogram(key, NUM_BINS)  # [NUM_BINS] int32
    bins = tl.arange(0, NUM_BINS)
    padded = tl.where(bins < E, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    first = tl.sum(tl.where(bins < expert, padded, 0))  # the group's first aligned row
    size = tl.sum(tl.where(bins == expert, padded, 0))
    mine = key == expert
    rank = tl.cumsum(mine.to(tl.int32), 0) - 1  # slot order within the group
    tl.store(sorted_slots_ptr + first + rank, slots, mask=mine)
    blocks = first // BLOCK_M + tl.arange(0, BLOCK_B)
    owner = tl.full((BLOCK_B,), 0, tl.int32) + expert
    tl.store(block_expert_ptr + blocks, owner, mask=blocks < (first + size) // BLOCK_M)


# ---- launchers --------------------------------------------------------------------------------------


def topk_route(logits: torch.Tensor, token_k: torch.Tensor, max_k: int, weighting: Weighting) -> RouteOutput:
    """ops.topk_route for fp32 logits [R, E] on the GPU -> ids [R, K] int64, weights [R, K] fp32."""
    rows, num_experts = logits.shape
    ids = torch.empty(rows, max_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(rows, max_k, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return RouteOutput(ids, weights)
    _topk_route_kernel[(rows,)](
        logits.contiguous(),
        token_k.contiguous(),
        ids,
        weights,
        **_route_constexprs(num_experts, max_k, weighting),
        num_warps=1,
    )
    return RouteOutput(ids, weights)


def _route_constexprs(num_experts: int, max_k: int, weighting: Weighting) -> dict[str, int]:
    return {
        "E": num_experts,
        "K": max_k,
        "BLOCK_E": max(triton.next_power_of_2(num_experts), 2),
        "BLOCK_K": max(triton.next_power_of_2(max_k), 2),
        "WEIGHTING": int(weighting),
    }


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """static_moe.align, as one launch (and two fills) for up to ALIGN_MAX_SLOTS slots."""
    num_slots = topk_ids.numel()
    if num_slots > ALIGN_MAX_SLOTS:
        return align_torch(topk_ids, num_experts, block_m)
    rows = capacity(num_slots, num_experts, block_m)
    device = topk_ids.device
    sorted_slots = torch.full((rows,), num_slots, dtype=torch.int32, device=device)
    block_expert = torch.full((rows // block_m,), -1, dtype=torch.int32, device=device)
    constexprs = _align_constexprs(num_slots, num_experts, block_m)
    _align_kernel[(num_experts,)](topk_ids.contiguous(), sorted_slots, block_expert, num_slots, **constexprs)
    return Alignment(sorted_slots, block_expert, block_m)


def _align_constexprs(num_slots: int, num_experts: int, block_m: int) -> dict[str, int]:
    return {
        "E": num_experts,
        "BLOCK_M": block_m,
        "BLOCK_S": max(triton.next_power_of_2(num_slots), 16),
        "NUM_BINS": triton.next_power_of_2(num_experts + 2),
        "BLOCK_B": triton.next_power_of_2(-(-num_slots // block_m) + 1),  # a group spans <= ceil(S / BM) blocks
    }


# ---- ahead-of-time configurations (tests/unit/kernels/cuda/test_cuda_compile.py) --------------------


def _specs() -> list[CompileSpec]:
    """The bundled demos' and the benchmarks' routers (8 and 16 experts), a Qwen3-size one (128 experts, k 8),
    in each weighting; the alignment at decode sizes up to its limit."""
    specs: list[CompileSpec] = []
    route_args = {"logits_ptr": "*fp32", "token_k_ptr": "*i64", "ids_ptr": "*i64", "weights_ptr": "*fp32"}
    for num_experts, max_k in ((8, 2), (8, 8), (16, 16), (128, 8)):
        for weighting in Weighting:
            constexprs = _route_constexprs(num_experts, max_k, weighting)
            signature = {**route_args, **dict.fromkeys(constexprs, "constexpr")}
            name = f"topk_route[E={num_experts},K={max_k},{weighting.name.lower()}]"
            specs.append(CompileSpec(name, _topk_route_kernel, signature, constexprs, num_warps=1, num_stages=1))
    align_args = {"ids_ptr": "*i64", "sorted_slots_ptr": "*i32", "block_expert_ptr": "*i32", "num_slots": "i32"}
    for num_slots, num_experts, block_m in ((2, 8, 64), (128, 8, 64), (512, 128, 16), (ALIGN_MAX_SLOTS, 16, 64)):
        constexprs = _align_constexprs(num_slots, num_experts, block_m)
        signature = {**align_args, **dict.fromkeys(constexprs, "constexpr")}
        name = f"align[S={num_slots},E={num_experts},BM={block_m}]"
        specs.append(CompileSpec(name, _align_kernel, signature, constexprs, num_warps=4, num_stages=1))
    return specs


SM90_SPECS: list[CompileSpec] = _specs()
