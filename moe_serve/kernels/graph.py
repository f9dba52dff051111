"""The graph family of the kernels: the ops of moe_serve.kernels.ops over a *padded* batch, in plain torch
ops that `torch.onnx.export`'s tracer records (docs/architecture.md §6, §7). The model's own layers run on
it unchanged: they call ops.attention, ops.rotary_write and the per-sequence ops with the step's batch,
and ops dispatches here when that batch is a PaddedBatch (and to moe_experts here while tracing), so the
ONNX export traces the network the engine serves instead of a second spelling of it.

Legend: B rows, T new tokens per row, M = B * T token rows, P past tokens, S = P + T keys, H query heads,
G key/value heads, Dh head dim, D hidden, E experts, K slots, R relative distances.

A padded batch is what an ONNX graph takes: rows left-padded to T new tokens after P past tokens, a mask
over all S, and keys and values passed in (past) and out (present) instead of a paged cache. Padding
tokens have k = 0 (no experts), see every key of their own row's past plus themselves (a finite softmax,
no NaN for later layers to carry), and their outputs are discarded. Shapes are read from tensors, never
baked in: the tracer records them as graph sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_serve.kernels.rotary import apply_rotary
from moe_serve.kernels.vocabulary import ACTIVATIONS, ExpertWeights, RelativeTerm, Weight, glu


@dataclass(frozen=True, slots=True)
class PaddedBatch:
    """B rows of T new tokens (left-padded) after P past tokens, laid out as [B, T] (tokens are [M] rows)."""

    positions: torch.Tensor  # [M] int64, each token's place in its sequence (padding: 0)
    key_positions: torch.Tensor  # [B, S] int64, the same for every key
    allowed: torch.Tensor  # [B, T, S] bool, which keys each query sees
    token_mask: torch.Tensor  # [B, T] float, 1 for real tokens

    @classmethod
    def build(cls, key_mask: torch.Tensor, num_new: int, causal: bool) -> PaddedBatch:
        """key_mask [B, S] int64 (1 for real tokens, the past included), num_new = T (a traced size)."""
        s = key_mask.shape[1]
        key_positions = (torch.cumsum(key_mask, dim=1) - 1).clamp(min=0)  # [B, S] a token's place in its row
        query_mask = key_mask[:, s - num_new :]  # [B, T]
        query_index = torch.arange(num_new, device=key_mask.device) + (s - num_new)  # [T] each query's key index
        key_index = torch.arange(s, device=key_mask.device)  # [S]
        visible = key_mask[:, None, :].bool()  # [B, 1, S]
        if causal:
            visible = visible & (key_index[None, :] <= query_index[:, None])[None]
        allowed = visible | (key_index[None, :] == query_index[:, None])[None]  # [B, T, S]: itself, always
        positions = key_positions[:, s - num_new :].reshape(-1)
        return cls(positions, key_positions, allowed, query_mask.float())


@dataclass(slots=True)
class GraphCache:
    """One layer's keys and values in a graph: `past` comes in, rotary_write sets `present` (past and this
    run's tokens, [B, G, S, Dh] each), which goes out."""

    past: tuple[torch.Tensor, torch.Tensor]  # [B, G, P, Dh] x2
    present: tuple[torch.Tensor, torch.Tensor] | None = field(default=None)


def rotary_write(
    q: torch.Tensor,  # [M, H, Dh]
    k: torch.Tensor,  # [M, G, Dh]
    v: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,  # cos, sin [M, Dh]
    cache: GraphCache | None,
    batch: PaddedBatch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.rotary_write: rotary on q and k, and k, v appended to the layer's past -> (q, k)."""
    if rotary is not None:
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
    if cache is not None:
        b, t = batch.token_mask.shape
        new_k = k.reshape(b, t, k.shape[1], k.shape[2]).transpose(1, 2)  # [B, G, T, Dh]
        new_v = v.reshape(b, t, v.shape[1], v.shape[2]).transpose(1, 2)
        cache.present = (torch.cat([cache.past[0], new_k], dim=2), torch.cat([cache.past[1], new_v], dim=2))
    return q, k


def attention(
    q: torch.Tensor,  # [M, H, Dh]
    k: torch.Tensor,  # [M, G, Dh] this run's keys (the cache's present holds them after its past)
    v: torch.Tensor,
    batch: PaddedBatch,
    cache: GraphCache | None,
    causal: bool,
    scale: float,
    relative: RelativeTerm | None = None,
) -> torch.Tensor:
    """ops.attention over a padded batch: softmax(q k^T * scale [+ relative]) v over each query's allowed
    keys of its own row -> [M, H, Dh]."""
    b, t = batch.token_mask.shape
    h, g, dh = q.shape[1], k.shape[1], q.shape[2]
    if cache is not None:
        assert cache.present is not None, "rotary_write sets the present keys first"
        keys, values = cache.present  # [B, G, S, Dh]
    else:
        keys, values = k.reshape(b, t, g, dh).transpose(1, 2), v.reshape(b, t, g, dh).transpose(1, 2)
    # Grouped-query attention: query head j reads key/value head j // (H / G).
    keys = keys[:, :, None].expand(-1, -1, h // g, -1, -1).reshape(b, h, -1, dh)  # [B, H, S, Dh]
    values = values[:, :, None].expand(-1, -1, h // g, -1, -1).reshape(b, h, -1, dh)
    queries = q.reshape(b, t, h, dh).transpose(1, 2)  # [B, H, T, Dh]
    scores = torch.matmul(queries, keys.transpose(2, 3))  # [B, H, T, S]
    if relative is not None:
        scores = scores + _relative_scores(relative, batch, causal, b, t)
    scores = (scores * scale).masked_fill(~batch.allowed[:, None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [B, H, T, Dh]
    return out.transpose(1, 2).reshape(b * t, h, dh)


def _relative_scores(relative: RelativeTerm, batch: PaddedBatch, causal: bool, b: int, t: int) -> torch.Tensor:
    """Transformer-XL's positional term (q + r_r_bias) . r_k[i - j]: [B, H, T, S]. Every query against every
    distance a key can be at (a slice of the table), then one gather by distance (the rel-shift as an
    index), instead of a projection per (query, key) pair."""
    table, offset = relative.r_k, relative.offset  # [R, H, Dh]
    h = table.shape[1]
    q_rel = relative.q_rel.reshape(b, t, h, -1).transpose(1, 2)  # [B, H, T, Dh]
    s = batch.key_positions.shape[1]
    low = 0 if causal else offset - (s - 1)
    rows = table[low : offset + s]  # [R', H, Dh]
    by_distance = torch.matmul(q_rel, rows.permute(1, 2, 0))  # [B, H, T, R']
    query_pos = batch.positions.reshape(b, t)
    distance = query_pos[:, :, None] - batch.key_positions[:, None, :] + (offset - low)  # [B, T, S]
    # A key after the query (masked anyway) has a negative distance; no distance exceeds the slice.
    index = distance.clamp(min=0)[:, None].expand(-1, h, -1, -1)  # [B, H, T, S]
    return torch.gather(by_distance, 3, index)


def moe_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, bank: ExpertWeights
) -> torch.Tensor:
    """ops.moe_experts in ops a trace records: x [M, D], topk_ids [M, K] (-1: unused), topk_weights [M, K]
    -> [M, D]. Each expert runs on the token slots routed to it only (NonZero, Gather, MatMul, ScatterND),
    so a slot beyond a row's k is never computed; slots are combined in slot order."""
    m, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)  # [M * K] slot -> expert
    per_slot = x.new_zeros(m * k, x.shape[-1])  # [M * K, D]

    def linear(h: torch.Tensor, w: Weight, b: torch.Tensor | None, e: int) -> torch.Tensor:
        assert isinstance(w, torch.Tensor), "the ONNX export takes float weights only"
        out = torch.matmul(h, w[e].transpose(0, 1))
        return out if b is None else out + b[e]

    for e in range(bank.w1.shape[0]):
        slots = torch.nonzero(flat_ids == e).reshape(-1)  # [n_e] the slots routed to expert e
        xs = x[torch.div(slots, k, rounding_mode="floor")]
        h = linear(xs, bank.w1, bank.b1, e)
        if bank.w3 is not None:
            h = glu(bank.activation, h, linear(xs, bank.w3, bank.b3, e), bank.swiglu)
        else:
            h = ACTIVATIONS[bank.activation](h)
        per_slot = per_slot.index_put((slots,), linear(h, bank.w2, bank.b2, e))
    return (per_slot.reshape(m, k, -1).float() * topk_weights[..., None]).sum(1).to(x.dtype)


# ---- per-sequence ops (routers that decide once per input) -------------------------------------------


def sequence_means(x: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
    """x [M, D] -> each row's mean over its real tokens [B, D] fp32."""
    b, t = batch.token_mask.shape
    mask = batch.token_mask[..., None]  # [B, T, 1]
    return (x.float().reshape(b, t, -1) * mask).sum(1) / mask.sum(1)


def sequence_lengths(batch: PaddedBatch) -> torch.Tensor:
    """[B] real tokens of each row."""
    return batch.token_mask.sum(1)


def to_tokens(values: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
    """values [B, ...] -> [M, ...]: each row's value for each of its tokens (padding included)."""
    t = batch.token_mask.shape[1]
    return values[:, None].expand(-1, t, *values.shape[1:]).reshape(-1, *values.shape[1:])


def merge(weights: torch.Tensor, ids: torch.Tensor, param: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
    """weights [B, K], ids [B, K], param [E, ...] -> [B, ...]: each row's weighted average of its chosen
    experts' parameter, summed in slot order."""
    w = weights.to(param.dtype)
    for _ in range(param.dim() - 1):
        w = w[..., None]
    return (w * param[ids]).sum(1)


def sequence_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, batch: PaddedBatch
) -> torch.Tensor:
    """x [M, in], weight [B, out, in], bias [B, out] -> [M, out]: each row's tokens through its own linear map."""
    b, t = batch.token_mask.shape
    out = torch.matmul(x.reshape(b, t, -1), weight.transpose(1, 2))  # [B, T, out]
    if bias is not None:
        out = out + bias[:, None]
    return out.reshape(b * t, -1)
