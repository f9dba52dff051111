"""The MoE experts as Triton kernels: ops.moe_experts for CUDA tensors, with static shapes and no host sync.

The routing's slots are aligned as moe_serve.kernels.static_moe.align defines (a stable sort by expert, each
group padded to whole blocks of BLOCK_M rows, in a capacity fixed by the shapes; one launch for a decode
step's slots: moe_serve.kernels.cuda.routing), then three launches:

1. gate/up: per block, its rows' tokens times its expert's w1 (and w3), biases and the activation fused,
   into the intermediate of each slot [S, I] (x's dtype);
2. down: per block, the intermediate times w2, plus b2, rounded to x's dtype (each expert's output, as in
   reference.moe_experts_torch) and times the slot's routing weight, into each slot's result [S, D] fp32;
3. combine: per token, its slots' results added in slot order k = 0..K-1 in fp32, unused slots (id < 0)
   skipped. A token's slots lie in different blocks, so without atomics (whose order varies from run to
   run) their sum cannot be fused into the down kernel; this third pass keeps the sum's order fixed.

Batch invariance: the tiling (BLOCK_M/N/K, warps, stages) is chosen from the dtype and the bank's shape
(D, I, E) only, never from the token count, so each row's dot products run the same instructions in the
same reduction order whatever else is in the batch, and a row's result does not depend on the other rows.
fp32 runs IEEE fp32 dots (no TF32), so CUDA fp32 can match the CPU's fp32 tokens; bf16 and fp16 run on
tensor cores with fp32 accumulation.

The bank's shape (D, I) and the artifact's max k (K) are fixed per model, so they are constexprs: the
compiler knows them (masks fold away where they divide the blocks), and Triton's interpreter, which
cannot take a runtime int as a loop bound under numpy >= 2.4, runs the same code. Only the token count
(num_slots) is a runtime argument.

Legend: T tokens, K slots (the artifact's max k), S = T * K slots, E experts, D hidden, I intermediate,
C capacity (aligned rows), NB = C / BLOCK_M blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_serve.kernels.cuda.common import CompileSpec, interpreting
from moe_serve.kernels.cuda.routing import align
from moe_serve.kernels.vocabulary import ACTIVATION_IDS, ExpertWeights

# ---- kernels ----------------------------------------------------------------------------------------


# INTERPRET (a constexpr, off on the GPU) works around two faults of Triton's interpreter: its bf16 dot is
# wrong (triton-lang/triton#11584), so the operands go to fp32 first, and its fp32 -> bf16 cast truncates,
# so bf16 results are rounded to nearest even first, as the GPU's cast does.


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a @ b in fp32. fp32 operands: IEEE (no TF32)."""
    if INTERPRET or a.dtype == tl.float32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _activate(v, ACTIVATION: tl.constexpr):
    """vocabulary.ACTIVATIONS by ACTIVATION_IDS: relu 0, gelu (erf) 1, gelu_tanh 2, silu 3; v fp32."""
    if ACTIVATION == 0:
        v = tl.maximum(v, 0.0)
    elif ACTIVATION == 1:
        v = 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))
    elif ACTIVATION == 2:
        inner = 0.7978845608028654 * (v + 0.044715 * v * v * v)
        v = v * tl.sigmoid(2.0 * inner)  # 0.5 * (1 + tanh(u)) = sigmoid(2u): no tanh in tl's core
    else:
        v = v * tl.sigmoid(v)
    return v


@triton.jit
def _cast(v, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """v fp32 -> dtype, rounded to nearest even."""
    if INTERPRET and dtype == tl.bfloat16:  # the interpreter's cast truncates: round the fp32 bits first
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype)


# The token count is not specialized on (num_slots % 16, as the JIT would): one binary for every batch size,
# so nothing in a row's code path depends on the batch, and no recompiles as it changes.
@triton.jit(do_not_specialize=["num_slots"])
def _gate_up_kernel(
    x_ptr,  # [T, D]
    w1_ptr,  # [E, I, D]
    b1_ptr,  # [E, I]
    w3_ptr,  # [E, I, D]
    b3_ptr,  # [E, I]
    h_ptr,  # [S, I] out, x's dtype
    sorted_slots_ptr,  # [C] int32
    block_expert_ptr,  # [NB] int32
    num_slots,
    num_k,
    D: tl.constexpr,
    I: tl.constexpr,
    ACTIVATION: tl.constexpr,
    GLU: tl.constexpr,
    HAS_B1: tl.constexpr,
    HAS_B3: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One block of BLOCK_M aligned rows x BLOCK_N intermediate units: act(x w1^T + b1) [* (x w3^T + b3)]."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:  # past the last group
        return
    slots = tl.load(sorted_slots_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    valid = slots < num_slots
    tokens = (slots // num_k).to(tl.int64)
    units = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    unit_ok = units < I
    expert_base = expert.to(tl.int64) * I * D  # int64: E * I * D passes 2^31 in large banks
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < D
        a = tl.load(x_ptr + tokens[:, None] * D + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_offsets = expert_base + units[None, :] * D + ks[:, None]  # [BK, BN]: w^T's tile
        w_mask = k_ok[:, None] & unit_ok[None, :]
        acc1 = _dot(a, tl.load(w1_ptr + w_offsets, mask=w_mask, other=0.0), acc1, INTERPRET)
        if GLU:
            acc3 = _dot(a, tl.load(w3_ptr + w_offsets, mask=w_mask, other=0.0), acc3, INTERPRET)
    bias_offsets = expert.to(tl.int64) * I + units
    if HAS_B1:
        acc1 += tl.load(b1_ptr + bias_offsets, mask=unit_ok, other=0.0).to(tl.float32)[None, :]
    h = _activate(acc1, ACTIVATION)
    if GLU:
        if HAS_B3:
            acc3 += tl.load(b3_ptr + bias_offsets, mask=unit_ok, other=0.0).to(tl.float32)[None, :]
        h = h * acc3
    h_offsets = slots.to(tl.int64)[:, None] * I + units[None, :]
    tl.store(h_ptr + h_offsets, _cast(h, h_ptr.dtype.element_ty, INTERPRET), mask=valid[:, None] & unit_ok[None, :])


@triton.jit(do_not_specialize=["num_slots"])
def _down_kernel(
    h_ptr,  # [S, I]
    w2_ptr,  # [E, D, I]
    b2_ptr,  # [E, D]
    weights_ptr,  # [S] fp32 routing weights
    slot_out_ptr,  # [S, D] fp32 out
    sorted_slots_ptr,  # [C] int32
    block_expert_ptr,  # [NB] int32
    num_slots,
    D: tl.constexpr,
    I: tl.constexpr,
    HAS_B2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One block of BLOCK_M aligned rows x BLOCK_N hidden units: (h w2^T + b2) * the slot's weight."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    slots = tl.load(sorted_slots_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    slot_rows = slots.to(tl.int64)
    units = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    unit_ok = units < D
    expert_base = expert.to(tl.int64) * D * I
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < I
        a = tl.load(h_ptr + slot_rows[:, None] * I + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & unit_ok[None, :]  # other=0: a masked lane's garbage times a's 0 may be NaN
        w = tl.load(w2_ptr + expert_base + units[None, :] * I + ks[:, None], mask=w_mask, other=0.0)
        acc = _dot(a, w, acc, INTERPRET)
    if HAS_B2:
        acc += tl.load(b2_ptr + expert.to(tl.int64) * D + units, mask=unit_ok, other=0.0).to(tl.float32)[None, :]
    # The expert's output in x's dtype, as every other path has it, then weighed in fp32.
    expert_out = _cast(acc, h_ptr.dtype.element_ty, INTERPRET).to(tl.float32)
    routing_weight = tl.load(weights_ptr + slot_rows, mask=valid, other=0.0)
    mask = valid[:, None] & unit_ok[None, :]
    tl.store(slot_out_ptr + slot_rows[:, None] * D + units[None, :], expert_out * routing_weight[:, None], mask=mask)


@triton.jit
def _combine_kernel(
    slot_out_ptr,  # [S, D] fp32
    ids_ptr,  # [S] int64, -1: unused
    out_ptr,  # [T, D]
    D: tl.constexpr,
    NUM_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One token x BLOCK_D hidden units: its slots' results summed in slot order in fp32."""
    token = tl.program_id(0).to(tl.int64)
    units = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    unit_ok = units < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(NUM_K):
        slot = token * NUM_K + j
        used = tl.load(ids_ptr + slot) >= 0
        # An unused slot's row was never written: masked, it is not read at all (0 * garbage may be NaN).
        acc += tl.load(slot_out_ptr + slot * D + units, mask=unit_ok & used, other=0.0)
    tl.store(out_ptr + token * D + units, _cast(acc, out_ptr.dtype.element_ty, INTERPRET), mask=unit_ok)


# ---- configuration ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tiling:
    """Block sizes and launch settings of the three kernels for one bank."""

    block_m: int  # aligned rows per block
    gate_up_n: int  # intermediate units per gate/up program
    gate_up_k: int  # hidden units per step of its reduction
    down_n: int  # hidden units per down program
    down_k: int  # intermediate units per step of its reduction
    combine_d: int  # hidden units per combine program
    num_warps: int
    num_stages: int


def _fit(block: int, size: int) -> int:
    """block, or less for a small dimension: the next power of two >= size, at least 16 (tl.dot's minimum)."""
    return max(16, min(block, triton.next_power_of_2(size)))


def tiling(dtype: torch.dtype, hidden: int, intermediate: int, num_experts: int) -> Tiling:
    """The tiling for a bank: from the dtype and (D, I, E) only, NEVER from the token count, since a
    different tiling reduces in a different order and a row's result would then change with its batch.
    Few experts (Mixtral's 8) see long groups in prefill, so blocks of 64 rows; many small experts
    (Qwen3's 128) see short ones, so blocks of 16 waste less padding. 16-bit 64-row tiles take 8 warps (with
    4, GLU's two 64 x 128 fp32 accumulators need 242 registers a thread). fp32 runs FMA dots (IEEE), whose
    operand tiles live in registers: narrower reduction steps, or Mixtral's gate/up spills."""
    block_m = 64 if num_experts <= 16 else 16
    wide = dtype != torch.float32
    n, k = (128, 64) if wide else (64, 16)
    return Tiling(
        block_m=block_m,
        gate_up_n=_fit(n, intermediate),
        gate_up_k=_fit(k, hidden),
        down_n=_fit(n, hidden),
        down_k=_fit(k, intermediate),
        combine_d=_fit(1024, hidden),
        num_warps=8 if wide and block_m == 64 else 4,
        num_stages=3 if wide else 2,
    )


_COMBINE_LAUNCH = {"num_warps": 4, "num_stages": 1}  # a short loop over K: nothing to pipeline


# ---- launcher ---------------------------------------------------------------------------------------


def moe_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, bank: ExpertWeights
) -> torch.Tensor:
    """ops.moe_experts on the Triton kernels: x [T, D], topk_ids [T, K] int64 (-1: unused), topk_weights
    [T, K] fp32 -> [T, D] in x's dtype. A token whose every slot is unused gets exactly 0. Under Triton's
    interpreter the tensors are CPU ones."""
    t, num_k = topk_ids.shape
    # ops.moe_experts hands packed (quantized) banks over dequantized
    assert isinstance(bank.w1, torch.Tensor) and isinstance(bank.w2, torch.Tensor), "a packed bank"
    assert bank.w3 is None or isinstance(bank.w3, torch.Tensor), "a packed bank"
    num_experts, intermediate, hidden = bank.w1.shape
    assert bank.w1.dtype == x.dtype, "the bank and the activations share one dtype"
    parts = (bank.w1, bank.w2, bank.w3, bank.b1, bank.b3, bank.b2)
    assert all(p is None or p.is_contiguous() for p in parts), "the kernels index contiguous weights and biases"
    out = x.new_empty(t, hidden)
    if t == 0:
        return out
    tile = tiling(x.dtype, hidden, intermediate, num_experts)
    alignment = align(topk_ids, num_experts, tile.block_m)
    num_blocks = alignment.block_expert.shape[0]
    num_slots = t * num_k
    x = x.contiguous()
    ids = topk_ids.contiguous()
    h = x.new_empty(num_slots, intermediate)
    slot_out = torch.empty(num_slots, hidden, dtype=torch.float32, device=x.device)
    interpret = interpreting()
    # Absent biases and w3 are never read (their constexpr flag is off); any pointer stands in.
    _gate_up_kernel[(num_blocks, triton.cdiv(intermediate, tile.gate_up_n))](
        x,
        bank.w1,
        bank.b1 if bank.b1 is not None else bank.w1,
        bank.w3 if bank.w3 is not None else bank.w1,
        bank.b3 if bank.b3 is not None else bank.w1,
        h,
        alignment.sorted_slots,
        alignment.block_expert,
        num_slots,
        num_k,
        D=hidden,
        I=intermediate,
        ACTIVATION=ACTIVATION_IDS[bank.activation],
        GLU=bank.w3 is not None,
        HAS_B1=bank.b1 is not None,
        HAS_B3=bank.b3 is not None,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.gate_up_n,
        BLOCK_K=tile.gate_up_k,
        INTERPRET=interpret,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    _down_kernel[(num_blocks, triton.cdiv(hidden, tile.down_n))](
        h,
        bank.w2,
        bank.b2 if bank.b2 is not None else bank.w2,
        topk_weights.to(torch.float32).contiguous(),
        slot_out,
        alignment.sorted_slots,
        alignment.block_expert,
        num_slots,
        D=hidden,
        I=intermediate,
        HAS_B2=bank.b2 is not None,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.down_n,
        BLOCK_K=tile.down_k,
        INTERPRET=interpret,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    _combine_kernel[(t, triton.cdiv(hidden, tile.combine_d))](
        slot_out, ids, out, D=hidden, NUM_K=num_k, BLOCK_D=tile.combine_d, INTERPRET=interpret, **_COMBINE_LAUNCH
    )
    return out


# ---- ahead-of-time configurations (tests/unit/kernels/cuda/test_cuda_compile.py) --------------------

_TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True, slots=True)
class _Bank:
    """A bank shape the launcher is compiled for ahead of time."""

    name: str
    hidden: int
    intermediate: int
    num_experts: int
    activation: str
    glu: bool
    has_b1: bool  # b1 and, with GLU, b3
    has_b2: bool
    num_k: int  # the artifact's max k


# The bundled models' banks (MLP relu experts with biases; SMEAR / switch adapters, silu, b1 only;
# HyperMoE's 16-unit adapters, one per pattern: 8 at k = 1), a Mixtral and a Qwen3-MoE size (SwiGLU, no
# biases; few and many experts), and one bank per other activation.
_BANKS = (
    _Bank("demo_mlp", 128, 128, 8, "relu", glu=False, has_b1=True, has_b2=True, num_k=8),
    _Bank("demo_adapter", 128, 128, 8, "silu", glu=False, has_b1=True, has_b2=False, num_k=8),
    _Bank("demo_hyper", 128, 16, 8, "relu", glu=False, has_b1=True, has_b2=True, num_k=1),
    _Bank("mixtral", 4096, 14336, 8, "silu", glu=True, has_b1=False, has_b2=False, num_k=2),
    _Bank("qwen3_moe", 2048, 768, 128, "silu", glu=True, has_b1=False, has_b2=False, num_k=8),
    _Bank("gelu_glu", 1024, 512, 64, "gelu", glu=True, has_b1=True, has_b2=True, num_k=4),
    _Bank("gelu_tanh_mlp", 1024, 4096, 8, "gelu_tanh", glu=False, has_b1=True, has_b2=True, num_k=2),
)


def _spec(name: str, kernel, args: dict[str, str], constexprs: dict, num_warps: int, num_stages: int) -> CompileSpec:
    signature = {**args, **dict.fromkeys(constexprs, "constexpr")}
    return CompileSpec(name, kernel, signature, constexprs, num_warps, num_stages)


def _specs() -> list[CompileSpec]:
    """Every constexpr combination the launcher picks for _BANKS, in each dtype (INTERPRET off: on the GPU)."""
    specs: list[CompileSpec] = []
    for dtype, ty in _TRITON_DTYPES.items():
        combines: set[tuple[int, int, int]] = set()
        for bank in _BANKS:
            tile = tiling(dtype, bank.hidden, bank.intermediate, bank.num_experts)
            launch = {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
            shape = {"D": bank.hidden, "I": bank.intermediate}
            aligned = {"sorted_slots_ptr": "*i32", "block_expert_ptr": "*i32", "num_slots": "i32"}
            gate_up_args = {
                **dict.fromkeys(("x_ptr", "w1_ptr", "b1_ptr", "w3_ptr", "b3_ptr", "h_ptr"), f"*{ty}"),
                **aligned,
                "num_k": "i32",
            }
            gate_up = {
                **shape,
                "ACTIVATION": ACTIVATION_IDS[bank.activation],
                "GLU": bank.glu,
                "HAS_B1": bank.has_b1,
                "HAS_B3": bank.has_b1 and bank.glu,
                "BLOCK_M": tile.block_m,
                "BLOCK_N": tile.gate_up_n,
                "BLOCK_K": tile.gate_up_k,
                "INTERPRET": False,
            }
            specs.append(_spec(f"moe_gate_up[{bank.name},{ty}]", _gate_up_kernel, gate_up_args, gate_up, **launch))
            down_args = {
                **dict.fromkeys(("h_ptr", "w2_ptr", "b2_ptr"), f"*{ty}"),
                **dict.fromkeys(("weights_ptr", "slot_out_ptr"), "*fp32"),
                **aligned,
            }
            down = {
                **shape,
                "HAS_B2": bank.has_b2,
                "BLOCK_M": tile.block_m,
                "BLOCK_N": tile.down_n,
                "BLOCK_K": tile.down_k,
                "INTERPRET": False,
            }
            specs.append(_spec(f"moe_down[{bank.name},{ty}]", _down_kernel, down_args, down, **launch))
            combines.add((bank.hidden, bank.num_k, tile.combine_d))
        combine_args = {"slot_out_ptr": "*fp32", "ids_ptr": "*i64", "out_ptr": f"*{ty}"}
        for hidden, num_k, width in sorted(combines):
            combine = {"D": hidden, "NUM_K": num_k, "BLOCK_D": width, "INTERPRET": False}
            name = f"moe_combine[D={hidden},K={num_k},{ty}]"
            specs.append(_spec(name, _combine_kernel, combine_args, combine, **_COMBINE_LAUNCH))
    return specs


SM90_SPECS: list[CompileSpec] = _specs()
