"""Attention as one Triton kernel: paged (keys and values read from the cache through each sequence's block
table) or packed (a whole sequence's own rows, no cache), for decode and for varlen prefill chunks alike.
Same results as reference.attention_torch; Transformer-XL relative attention is not here: its positional term
keeps reference.attention_torch (the slower path), and ops dispatches it there.

Legend: T tokens, S sequences, H query heads, G key/value heads, Dh head dim, NB blocks, BS block size,
MB blocks per sequence (the block table's width), M rows of a program's tile (query tokens x heads of a
group), N keys per loop iteration.

Program grid (tiles, G): a program takes one key/value head and, for that head's whole group of H / G query
heads, a tile of consecutive query tokens of one sequence, so every key and value it loads serves all of
them (GQA reads the cache once per group). Rows of the tile are (token, head) pairs, token-major. Decode
(one query per sequence: T == S, known from the shapes) takes one token per program, its group padded to
16 rows; a prefill chunk takes 64 // (H / G) tokens per program. Padding to 16 rather than a
broadcast-multiply-sum for small groups: decode is bound by reading the cache, so the idle rows of a tensor
core MMA cost nothing, whereas a [M, Dh, N] product in registers spills for any group beyond 2 or so and
would be a second code path to keep right. A sequence's context is not split across programs (no
flash-decoding split-K): a decode batch of few sequences and few kv heads occupies few SMs.

Online softmax in fp32 over N = max(64, BS) keys per iteration: with the default 16-key blocks, four blocks
gathered through the block table per iteration, so a 4k context is 64 iterations rather than 256 and each
iteration has four independent block reads in flight to hide the table's indirection; 64 keys keep the
K and V tiles (2 x 64 x Dh) small enough to double-buffer in shared memory for Dh up to 128 in fp32.

Nothing syncs with the host: the loop bound is each tile's last visible key, loaded on the device (its
largest position + 1 when causal, the sequence's num_keys otherwise), and the tile's sequence is found on
the device by a binary search over the sequences' first query rows. Under Triton's interpreter
(TRITON_INTERPRET=1, the CPU tests) a bf16 tl.dot gives garbage (triton#11584), so there the MMA operands are
upcast to fp32 (DOT_FP32).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from moe_serve.kernels.cuda.common import CompileSpec, interpreting

DECODE_ROWS = 16  # tl.dot's minimum M: a decode program's group is padded up to it
PREFILL_ROWS = 64  # (token, head) rows of a prefill program: 64 x Dh fp32 accumulators fit 4 warps' registers
MIN_KEYS = 64  # keys per loop iteration (several 16-key blocks: see the module docstring)
NUM_WARPS = 4
# Software pipelining: paged, 3 stages put the block table's load a step ahead of the K and V loads it
# addresses (still two K/V buffers: 80 KiB for bf16 Dh 128 prefill, 192 KiB fp32); packed has no
# indirection, and a third K/V buffer would take fp32 Dh 128 past the H100's 227 KiB.
PAGED_STAGES = 3
PACKED_STAGES = 2


# The runtime scalars are never specialized (Triton would otherwise compile a variant for each that happens
# to be 1, or a multiple of 16), so what runs is exactly what SM90_SPECS builds ahead of time.
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "heads", "kv_heads", "tile_tokens", "table_width", "causal"])
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_tables_ptr,
    seq_ids_ptr,
    positions_ptr,
    num_keys_ptr,
    seq_starts_ptr,
    num_seqs,
    num_tokens,
    heads,
    kv_heads,
    tile_tokens,
    table_width,
    causal,
    qk_scale,
    PAGED: tl.constexpr,
    DECODE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One (tile of query tokens, kv head) -> out rows. Every tensor is contiguous, so each address follows
    from the constexprs (and the head counts): the compiler can prove K and V rows aligned and contiguous
    (16 keys of a block, Dh of a value) and vectorize and pipeline their loads. Paged: k [NB, G, Dh, BS],
    v [NB, G, BS, Dh]; packed: k, v [T, G, Dh]."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    group = heads // kv_heads
    if DECODE:  # one token per program
        seq = tl.load(seq_ids_ptr + tile)
        first_token = tile.to(tl.int64)
        end_token = first_token + 1
    else:
        # Sequence s owns tiles seq_starts[s] // tile_tokens + s onwards (at least its ceil(n / tile_tokens));
        # find the last s whose first tile is <= this one. Tiles past a sequence's tokens do nothing.
        low = tile * 0
        high = num_seqs - 1 + tile * 0
        while low < high:
            mid = (low + high + 1) // 2
            mid_first = tl.load(seq_starts_ptr + mid) // tile_tokens + mid
            low = tl.where(mid_first <= tile, mid, low)
            high = tl.where(mid_first <= tile, high, mid - 1)
        seq = low
        seq_start = tl.load(seq_starts_ptr + seq)
        first_token = seq_start + (tile - (seq_start // tile_tokens + seq)) * tile_tokens
        end_token = tl.load(seq_starts_ptr + seq + 1, mask=seq + 1 < num_seqs, other=num_tokens)

    rows = tl.arange(0, BLOCK_M)
    token = first_token + rows // group
    head = kv_head * group + rows % group
    row_valid = (rows // group < tile_tokens) & (token < end_token)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM

    position = tl.load(positions_ptr + token, mask=row_valid, other=-1)
    seq_keys = tl.load(num_keys_ptr + seq)
    last = tl.max(position, 0)  # -1: no query in this tile
    key_end = tl.where(causal != 0, tl.minimum(last + 1, seq_keys), seq_keys)
    key_end = tl.where(last >= 0, key_end, 0)
    if PAGED:
        table = block_tables_ptr + seq.to(tl.int64) * table_width
        k_base = k_ptr + kv_head * (HEAD_DIM * BLOCK_SIZE) + dims[:, None] * BLOCK_SIZE
        v_base = v_ptr + kv_head * (BLOCK_SIZE * HEAD_DIM) + dims[None, :]
    else:
        key_start = tl.load(seq_starts_ptr + seq)
        k_base = k_ptr + kv_head * HEAD_DIM + dims[:, None]
        v_base = v_ptr + kv_head * HEAD_DIM + dims[None, :]

    q_mask = row_valid[:, None] & dim_valid[None, :]
    q_offset = (token * heads + head)[:, None] * HEAD_DIM + dims[None, :]  # out's too
    q = tl.load(q_ptr + q_offset, mask=q_mask, other=0.0)

    # A finite floor rather than -inf: a padding row (no visible key) then stays at exp2(-inf - floor) = 0
    # without a NaN; every real row sees key 0 in the first iteration, so the floor never reaches the output.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Counting steps rather than keys makes each step's first key a visible multiple of BLOCK_N: the compiler
    # then knows a block's 16 keys are contiguous in the cache (one vector load each, pipelined).
    for step in range(0, tl.cdiv(key_end, BLOCK_N)):
        keys = step * BLOCK_N + tl.arange(0, BLOCK_N)
        key_valid = keys < key_end
        # V is masked per key: a NaN past the sequence's end (an unwritten slot of its last block), times a
        # zero probability, would still be NaN. K needs no more than its block (the scores past the end are
        # replaced, NaN or not), and a mask constant over a block's 16 keys keeps their load one vector.
        if PAGED:
            block_start = step * BLOCK_N + tl.arange(0, BLOCK_N) // BLOCK_SIZE * BLOCK_SIZE
            k_valid = block_start < key_end
            block = tl.load(table + keys // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
            slot = tl.arange(0, BLOCK_N) % BLOCK_SIZE
            k_offset = block * (kv_heads * HEAD_DIM * BLOCK_SIZE) + slot
            v_offset = block * (kv_heads * BLOCK_SIZE * HEAD_DIM) + slot * HEAD_DIM
        else:  # past the end are other sequences' rows, or none
            k_valid = key_valid
            k_offset = (key_start + keys) * (kv_heads * HEAD_DIM)
            v_offset = k_offset
        k_t = tl.load(k_base + k_offset[None, :], mask=dim_valid[:, None] & k_valid[None, :], other=0.0)
        v = tl.load(v_base + v_offset[:, None], mask=key_valid[:, None] & dim_valid[None, :], other=0.0)
        k_t = k_t.to(q.dtype)
        v = v.to(q.dtype)
        # fp32 inputs: three tf32 MMAs (near-fp32 accuracy) rather than one (10-bit mantissa) or FMAs (slow);
        # 16-bit inputs ignore the precision.
        if DOT_FP32:
            scores = tl.dot(q.to(tl.float32), k_t.to(tl.float32), input_precision="ieee")
        else:
            scores = tl.dot(q, k_t, input_precision="tf32x3")
        visible = key_valid[None, :] & ((causal == 0) | (keys[None, :] <= position[:, None]))
        scores = tl.where(visible, scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(q.dtype)  # rounded as the MMA takes it, interpreted or not
        if DOT_FP32:
            pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p, v, input_precision="tf32x3")
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_offset, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_ids: torch.Tensor,
    positions: torch.Tensor,
    num_keys: torch.Tensor,
    causal: bool,
    scale: float,
    seq_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, Dh] over the cache (k_cache [NB, G, Dh, BS], v_cache [NB, G, BS, Dh], this step's keys
    already in) -> [T, H, Dh] in q's dtype. Query t of sequence seq_ids[t] sees that sequence's keys
    0..positions[t] (causal) or 0..num_keys[s] - 1, through block_tables [S, MB] int32. seq_ids are
    non-decreasing (a sequence's queries are consecutive rows); seq_starts [S] (AttentionBatch.seq_starts),
    the first row of each, is found from seq_ids when not given (prefill only; decode needs none)."""
    num_seqs = num_keys.shape[0]
    if seq_starts is None and q.shape[0] != num_seqs:
        seq_starts = torch.searchsorted(seq_ids, torch.arange(num_seqs, device=seq_ids.device, dtype=seq_ids.dtype))
    return _launch(q, k_cache, v_cache, block_tables, seq_ids, positions, num_keys, seq_starts, causal, scale)


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_starts: torch.Tensor,
    seq_ids: torch.Tensor,
    positions: torch.Tensor,
    num_keys: torch.Tensor,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """No cache (encoders, whole sequences in the step): q [T, H, Dh], k, v [T, G, Dh]; sequence s is rows
    seq_starts[s] .. seq_starts[s] + num_keys[s] - 1, its queries and its keys alike -> [T, H, Dh]."""
    return _launch(q, k, v, None, seq_ids, positions, num_keys, seq_starts, causal, scale)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_tables: torch.Tensor | None,
    seq_ids: torch.Tensor,
    positions: torch.Tensor,
    num_keys: torch.Tensor,
    seq_starts: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    tokens, heads, head_dim = q.shape
    num_seqs = num_keys.shape[0]
    kv_heads = k.shape[1]
    group = heads // kv_heads
    paged = block_tables is not None
    out = torch.empty(tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    config = attention_config(head_dim, group, decode=tokens == num_seqs, block_size=k.shape[-1] if paged else 0)
    tile_tokens = config["BLOCK_M"] // group
    tiles = tokens if config["DECODE"] else tokens // tile_tokens + num_seqs
    # Contiguous everywhere (see the kernel): the caches are (kv_cache allocates each layer's), q is (ops
    # passes it so); packed k and v, views of a fused projection, are copied (O(T), against O(T^2) here).
    if paged:
        assert block_tables is not None and k.is_contiguous() and v.is_contiguous()
        table = block_tables
    else:
        k, v = k.contiguous(), v.contiguous()
        table = seq_ids  # unused
    _attention_kernel[(tiles, kv_heads)](
        q.contiguous(),
        k,
        v,
        out,
        table,
        seq_ids,
        positions,
        num_keys,
        seq_starts if seq_starts is not None else seq_ids,  # decode reads no starts when paged
        num_seqs,
        tokens,
        heads,
        kv_heads,
        tile_tokens,
        table.shape[-1],
        int(causal),
        scale * math.log2(math.e),  # exp2 in the kernel
        num_warps=NUM_WARPS,
        num_stages=PAGED_STAGES if paged else PACKED_STAGES,
        **config,
    )
    return out


def attention_config(head_dim: int, group: int, decode: bool, block_size: int) -> dict[str, Any]:
    """The constexprs a launch picks (block_size 0: packed, no cache)."""
    rows = DECODE_ROWS if decode else PREFILL_ROWS
    return {
        "PAGED": block_size > 0,
        "DECODE": decode,
        "HEAD_DIM": head_dim,
        "BLOCK_M": max(rows, triton.next_power_of_2(group)),
        "BLOCK_N": max(MIN_KEYS, block_size),
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "BLOCK_SIZE": max(block_size, 1),
        "DOT_FP32": interpreting(),
    }


_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _spec(dtype: torch.dtype, head_dim: int, decode: bool, block_size: int) -> CompileSpec:
    config = attention_config(head_dim, 1, decode, block_size)
    config["DOT_FP32"] = False
    element = "*" + _TRITON_TYPES[dtype]
    pointers = {name: element for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    pointers.update(seq_ids_ptr="*i64", positions_ptr="*i64", num_keys_ptr="*i64", seq_starts_ptr="*i64")
    pointers["block_tables_ptr"] = "*i32" if block_size else "*i64"  # packed: seq_ids in its place
    signature = {
        name: pointers.get(name, "fp32" if name == "qk_scale" else "constexpr" if name in config else "i32")
        for name in _attention_kernel.arg_names
    }
    kind = f"{'paged' if block_size else 'packed'}_{'decode' if decode else 'prefill'}"
    name = f"attention_{kind}_{_TRITON_TYPES[dtype]}_d{head_dim}"
    stages = PAGED_STAGES if block_size else PACKED_STAGES
    return CompileSpec(name, _attention_kernel, signature, config, NUM_WARPS, stages)


# Every configuration for the head dims 64 and 128 and the demo models' 32, paged with the default 16-key
# blocks or packed, decode or prefill: groups up to 16 (decode) and 64 (prefill) share these row counts.
SM90_SPECS: list[CompileSpec] = [
    _spec(dtype, head_dim, decode, block_size)
    for dtype in _TRITON_TYPES
    for head_dim in (32, 64, 128)
    for block_size in (16, 0)
    for decode in (True, False)
]
