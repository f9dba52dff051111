"""The MoE experts with static shapes and no host sync: what the CUDA kernels (moe_serve.kernels.cuda.moe)
compute, written in plain torch.

The slots (token t's slot j is slot s = t * K + j) are sorted by expert with a stable sort, and each
expert's group is padded to a multiple of BLOCK_M rows, in a capacity that depends on the shapes only
(T * K + E * (BLOCK_M - 1), rounded up to whole blocks, as vLLM's moe_align_block_size). Every block then
belongs to one expert, so a grouped GEMM is one plain GEMM per block; the blocks past the last group,
and the padding rows inside a group, are skipped. Per-row k arrives as the -1 ids beyond each row's k (a
device tensor, never read on the host); an id of -1 (an unused slot, or an expert another process
holds) goes to no expert. Nothing here reads a tensor on the host (.item(), bincount, nonzero, boolean
indexing), so a CUDA graph can capture it.

Legend: T tokens, K slots (the artifact's max k), S = T * K slots, E experts, D hidden, I intermediate,
C capacity (aligned rows), NB = C / BLOCK_M blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_serve.kernels.vocabulary import ACTIVATIONS, ExpertWeights, Weight, float_weight, glu


@dataclass(frozen=True, slots=True)
class Alignment:
    """The slots sorted by expert, each expert's group padded to whole blocks."""

    sorted_slots: torch.Tensor  # [C] int32, the slot of each aligned row; S (one past the last slot): padding
    block_expert: torch.Tensor  # [NB] int32, the expert of each block; -1: past the last group, nothing to do
    block_m: int


def capacity(num_slots: int, num_experts: int, block_m: int) -> int:
    """Aligned rows for any routing of num_slots slots: each expert's group wastes under block_m rows."""
    padded = num_slots + num_experts * (block_m - 1)
    return -(-padded // block_m) * block_m


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """topk_ids [T, K] int64 (-1: no expert) -> the slots sorted by expert in blocks of block_m rows.
    The shapes depend on T, K, E and block_m only; ties keep slot order (stable sort)."""
    num_slots = topk_ids.numel()
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    # Slots of no expert get the key E: they sort after every group and are dropped below.
    key = torch.where(flat >= 0, flat, num_experts)  # [S]
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))  # [E + 1], bincount without its host sync
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts:].zero_()  # the no-expert group takes no rows (a fill: `padded[E] = 0` is a host copy)
    group_end = torch.cumsum(padded, 0)  # [E + 1] aligned row after each group
    group_first = group_end - padded  # [E + 1] its first aligned row
    order = torch.sort(key, stable=True).indices  # [S] slots by expert, slot order within one
    sorted_key = key[order]
    rank = torch.arange(num_slots, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_key]  # [S] in group
    rows = capacity(num_slots, num_experts, block_m)
    # The no-expert group lands on one extra row, cut off after the scatter.
    dest = torch.where(sorted_key < num_experts, group_first[sorted_key] + rank, rows)
    sorted_slots = torch.full((rows + 1,), num_slots, dtype=torch.int32, device=device)
    sorted_slots.scatter_(0, dest, order.to(torch.int32))
    block_first = torch.arange(0, rows, block_m, device=device)  # [NB]
    # The group a block starts in: the first whose end lies past the block's first row (E: past them all).
    block_expert = torch.searchsorted(group_end[:num_experts], block_first, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return Alignment(sorted_slots[:rows], block_expert, block_m)


def moe_experts_blocked(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, bank: ExpertWeights, block_m: int = 16
) -> torch.Tensor:
    """x [T, D], topk_ids [T, K] (-1: unused), topk_weights [T, K] fp32 -> [T, D], blocked as the Triton
    kernels are: per block, its rows' tokens through its expert (one bmm over all blocks), then each
    token's slots combined in slot order in fp32. The readable twin of moe_serve.kernels.cuda.moe, which
    CPU CI checks the alignment with; it gathers one weight copy per block, so it is a reference for small
    shapes, not a fast path."""
    t, k = topk_ids.shape
    num_slots = t * k
    alignment = align(topk_ids, bank.w1.shape[0], block_m)
    slots = alignment.sorted_slots.long().reshape(-1, block_m)  # [NB, BM]
    # Padding rows and idle blocks compute on token 0 and expert 0; their rows are dropped, never weighed.
    tokens = torch.where(slots < num_slots, slots // k, 0)
    experts = alignment.block_expert.long().clamp(min=0)  # [NB]
    xs = x[tokens]  # [NB, BM, D]

    def grouped(w: Weight, b: torch.Tensor | None, h: torch.Tensor) -> torch.Tensor:
        out = torch.bmm(h, float_weight(w, h.dtype)[experts].transpose(1, 2))
        return out if b is None else out + b[experts][:, None, :]

    h = grouped(bank.w1, bank.b1, xs)
    if bank.w3 is not None:
        h = glu(bank.activation, h, grouped(bank.w3, bank.b3, xs), bank.swiglu)
    else:
        h = ACTIVATIONS[bank.activation](h)
    block_out = grouped(bank.w2, bank.b2, h)  # [NB, BM, D]
    per_slot = x.new_zeros(num_slots + 1, x.shape[-1])  # [S + 1, D]; row S takes every padding row
    per_slot[slots.reshape(-1)] = block_out.reshape(-1, x.shape[-1])
    per_slot = per_slot[:num_slots].reshape(t, k, -1).float()
    used = topk_ids >= 0
    out = torch.zeros(t, x.shape[-1], dtype=torch.float32, device=x.device)
    for j in range(k):  # slot order, as the combine kernel; an unused slot adds nothing (where, not * 0)
        out = out + torch.where(used[:, j, None], per_slot[:, j] * topk_weights[:, j, None], 0.0)
    return out.to(x.dtype)
