"""Row reorders of the q and k projections: a family whose rotary pairs sit elsewhere in a head than the
runtime's (rotate-half: dim j with dim j + D/2 of the rotated part) has those rows permuted at export.

Every reorder here permutes the rows of q and k alike (and what is laid out as they are: their biases, a norm's
weights), so every q . k, and so the attention output, is unchanged. The families that use them: Llama 4
(interleaved pairs in every head), GLM-4.5 (partial rotary), DeepSeek-V2 / V3 (interleaved pairs in the rope
part of each head and of the shared key).
"""

from __future__ import annotations

import torch


def interleaved_to_halves(n: int) -> torch.Tensor:
    """The order taking n rows holding rotary pairs (x0, x1), (x2, x3), ... to the evens, then the odds: rotary on
    halves, the convention moe-serve computes."""
    return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])


def reorder_heads(rows: torch.Tensor, head_dim: int, order: torch.Tensor) -> torch.Tensor:
    """Rows of a q or k projection (or its bias, or a per-head norm's weights), each head's head_dim rows taken in
    `order`."""
    return rows.reshape(-1, head_dim, *rows.shape[1:])[:, order].reshape(rows.shape).contiguous()


def pairs_to_halves(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Llama 4 rotates interleaved pairs (x0, x1), (x2, x3), ... as complex numbers: its heads' rows put in the
    order of rotary on halves (x_j with x_{j + Dh/2})."""
    return reorder_heads(rows, head_dim, interleaved_to_halves(head_dim))


def partial_rotary_rows(rows: torch.Tensor, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """GLM-4.5's order (the first rotary_dim dims of a head rotate as two halves, the rest pass through) ->
    ModelConfig.rotary_dim's: rotated halves at 0 and head_dim / 2, each followed by half of the pass-through."""
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    order = torch.cat(
        [
            torch.arange(0, r),
            torch.arange(rotary_dim, rotary_dim + p),
            torch.arange(r, rotary_dim),
            torch.arange(rotary_dim + p, head_dim),
        ]
    )
    return reorder_heads(rows, head_dim, order)


def deinterleave(rope_rows: torch.Tensor) -> torch.Tensor:
    """Rows holding interleaved rotary pairs -> the evens, then the odds (DeepSeek's rope rows)."""
    return rope_rows[interleaved_to_halves(rope_rows.shape[0])]


def latent_q_rows(weight: torch.Tensor, heads: int, nope: int, rope: int) -> torch.Tensor:
    """DeepSeek's q (or q_b) projection [H * (nope + rope), in]: each head's last `rope` rows de-interleaved, its
    `nope` rows (which never rotate) kept."""
    per_head = weight.view(heads, nope + rope, -1)
    rope_part = torch.stack([deinterleave(head[nope:]) for head in per_head])
    return torch.cat([per_head[:, :nope], rope_part], dim=1).reshape(weight.shape).contiguous()


def latent_kv_rows(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """DeepSeek's kv_a projection (or its bias) [rank + rope, ...]: the latent's `rank` rows kept, the rope rows of
    the key every head shares de-interleaved."""
    return torch.cat([tensor[:rank], deinterleave(tensor[rank:])])
