"""Token sampling for a batch of rows, each with its own settings and random stream.

Legend: B rows, V vocabulary. A seeded row draws its noise from its own torch.Generator, so its text
depends only on its seed, never on what it is batched with.
"""

from __future__ import annotations

import torch

from moe_serve.engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float], list[dict[int, float]]]:
    """logits [B, V] fp32 -> chosen token ids, their log-probabilities (of the unfiltered distribution),
    and the top-n alternatives for rows that asked for logprobs."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
    device = logits.device
    temperature = torch.tensor([s.params.temperature for s in seqs], device=device)  # [B]
    top_k = torch.tensor([s.params.top_k for s in seqs], device=device)  # [B]
    top_p = torch.tensor([s.params.top_p for s in seqs], device=device)  # [B]
    is_greedy = temperature == 0

    chosen = logits.argmax(dim=-1)  # [B] greedy rows keep this
    if not bool(is_greedy.all()):
        scaled = logits / temperature.clamp(min=1e-5)[:, None]
        sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)  # [B, V]
        rank = torch.arange(logits.shape[-1], device=device)[None, :]
        drop = (top_k[:, None] > 0) & (rank >= top_k[:, None])
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        # Nucleus: drop a token once the mass before it already exceeds top_p (the first always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) > top_p[:, None]
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        noise = torch.stack([_exponential(logits.shape[-1], s.generator, device) for s in seqs])  # [B, V]
        # argmax(p / Exp(1)) draws from p (the exponential-race form of Gumbel-max), one noise vector per row.
        pick = (probs / noise.gather(1, sorted_ids)).argmax(dim=-1)  # [B]
        sampled = sorted_ids.gather(1, pick[:, None])[:, 0]
        chosen = torch.where(is_greedy, chosen, sampled)

    token_ids = chosen.tolist()
    token_logprobs = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
    tops: list[dict[int, float]] = []
    max_n = max((s.params.logprobs or 0) for s in seqs)
    if max_n:
        values, ids = logprobs.topk(max_n, dim=-1)
        values, ids = values.tolist(), ids.tolist()
    for row, seq in enumerate(seqs):
        n = seq.params.logprobs or 0
        tops.append({ids[row][j]: values[row][j] for j in range(n)} if n else {})
    return token_ids, token_logprobs, tops


def _exponential(size: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    return torch.empty(size, device=device).exponential_(generator=generator)
