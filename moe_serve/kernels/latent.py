"""Multi-head latent attention (MLA) over its own paged cache, in the absorbed form: every query head attends
to one shared key per token, [c, k_pe] (the normed latent and the rotated rope part, C = kv_lora_rank +
qk_rope_head_dim values), and reads the latent c as its value; the heads' own key and value maps are applied
to the query before and to the output after (moe_serve/layers/latent_attention.py). This is multi-query
attention with key size C and value size kv_lora_rank, so the cache keeps C values per token per layer where
keys and values per head would take H * (nope + rope + v).

Layout, per layer: one tensor [NB, BS, C]; row (block, offset) holds the token at that slot of the block
manager, as the K/V cache's slots do, so prefill, chunked prefill, a prefix-cache hit and decode read and
write the same rows. On the CPU, with float32 queries and cache, the attention is the C++ kernel
(csrc/latent_attention.cpp: an online softmax per query and head, each cache row read once for a
block of heads, any block size; a row's result is bitwise the same whatever it is batched with). Elsewhere (CUDA,
bf16, no cache, MOE_SERVE_KERNELS=torch) it is plain torch: one sequence at a time, scaled_dot_product_attention
on its gathered rows, or a decode-only step in one batched product. Neither has a static form: both read
sequence lengths on the host, so CUDA-graph decode refuses latent attention (engine.decode_graphs), as it
refuses every attention feature the static kernels lack.

Legend: T tokens of the step, H query heads, C = R + P (latent R, rope P), NB blocks, BS block size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn import functional as F

from moe_serve.kernels.vocabulary import AttentionBatch


class LatentCache(NamedTuple):
    """One latent-attention layer's paged cache."""

    latent: torch.Tensor  # [NB, BS, C]


def latent_cache_shape(num_blocks: int, block_size: int, width: int) -> tuple[int, int, int]:
    return num_blocks, block_size, width


def write_latent(cache: LatentCache, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """latent [T, C] into the cache rows slot_mapping [T] (block * BS + offset)."""
    rows = cache.latent.view(-1, cache.latent.shape[-1])
    rows[slot_mapping] = latent.to(rows.dtype)


def gather_latent(cache: LatentCache, block_table: torch.Tensor, num_keys: int) -> torch.Tensor:
    """A sequence's first num_keys cached rows, in order: [num_keys, C]."""
    block_size = cache.latent.shape[1]
    blocks = block_table[: -(-num_keys // block_size)].long()
    return cache.latent[blocks].reshape(-1, cache.latent.shape[-1])[:num_keys]


# The batched decode copies every sequence's latents to the longest one's length: above this many keys in all
# (one long sequence pads the others), the sequences run one at a time instead, in memory of their own size.
MAX_PADDED_KEYS = 1 << 16


def latent_attention_torch(
    q: torch.Tensor, latent: torch.Tensor, batch: AttentionBatch, cache: LatentCache | None, rank: int, scale: float
) -> torch.Tensor:
    """ops.latent_attention in plain torch, on any device and dtype: a decode-only step in one batched product
    (_decode), anything else one sequence at a time."""
    padded = len(batch.seq_lens) * max(batch.num_keys_host)
    if cache is not None and len(batch.seq_lens) > 1 and max(batch.seq_lens) == 1 and padded <= MAX_PADDED_KEYS:
        return _decode(q, batch, cache, rank, scale)
    out = q.new_empty(q.shape[0], q.shape[1], rank)
    start = 0
    for s, n in enumerate(batch.seq_lens):
        rows = slice(start, start + n)
        start += n
        num_keys = batch.num_keys_host[s]
        if cache is None:
            first = int(batch.seq_starts[s])
            keys = latent[first : first + num_keys]  # [S_k, C]
        else:
            assert batch.block_tables is not None
            keys = gather_latent(cache, batch.block_tables[s], num_keys)
        keys = keys.to(q.dtype)
        query_pos = batch.positions[rows]  # [n]
        key_pos = torch.arange(num_keys, device=q.device)
        mask = torch.zeros(n, num_keys, dtype=q.dtype, device=q.device).masked_fill(
            key_pos[None, :] > query_pos[:, None], float("-inf")
        )
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None],  # [1, H, n, C]
            keys[None, None],  # [1, 1, S_k, C]: one key head for every query head
            keys[None, None, :, :rank],  # [1, 1, S_k, R]
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = o[0].transpose(0, 1)
    return out


def _decode(q: torch.Tensor, batch: AttentionBatch, cache: LatentCache, rank: int, scale: float) -> torch.Tensor:
    """A decode-only step (one query per sequence, at its last position) in one batched product instead of a
    call per sequence: each sequence's rows gathered to the longest one's length, the rows past its own length
    zeroed (an unwritten slot may hold anything) and masked. A row's scores and output are those of the
    sequence alone up to the order of the additions over the padding's zeros (within fp32 rounding, as the
    torch paths promise; the C++ kernels' bitwise batch invariance is theirs alone)."""
    assert batch.block_tables is not None
    block_size, width = cache.latent.shape[1], cache.latent.shape[2]
    blocks = -(-max(batch.num_keys_host) // block_size)
    tables = batch.block_tables[:, :blocks].long()  # [S, blocks] (a shorter sequence's table is padded with 0)
    keys = cache.latent[tables].reshape(len(batch.seq_lens), blocks * block_size, width)  # [S, L, C]
    valid = torch.arange(keys.shape[1], device=q.device)[None, :] < batch.num_keys[:, None]  # [S, L]
    keys = keys.masked_fill(~valid[..., None], 0).to(q.dtype)
    scores = torch.einsum("shc,slc->shl", q, keys).float() * scale  # [S, H, L]
    probs = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1).to(q.dtype)
    return torch.einsum("shl,slr->shr", probs, keys[..., :rank])  # [S, H, R]
