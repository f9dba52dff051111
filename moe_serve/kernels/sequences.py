"""The per-sequence ops of routers that decide once per input (SMEAR, example top-k): pooling a sequence's
tokens, spreading a per-sequence value back to them, merging experts' parameters, and a per-sequence linear
map. Packed steps are computed here, one sequence at a time so that a sequence's result never depends on its
batch; a padded batch (the ONNX export) takes the graph family's forms (kernels.graph).

Legend: T tokens, S sequences, K slots, E experts, D hidden.
"""

from __future__ import annotations

import torch

from moe_serve.kernels import graph, ops
from moe_serve.kernels.graph import PaddedBatch
from moe_serve.kernels.vocabulary import AttentionBatch


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
    return torch.cat([ops.linear(part, weight[s], None if bias is None else bias[s]) for s, part in enumerate(parts)])
