"""How far packed weights move a language model's next-token distributions: the mean KL divergence
KL(p_float || p_packed), in nats per scored token, at a given k. Both models run the same whole texts in one
reference forward each (no cache, sequences packed; moe_serve.layers.batch.ForwardBatch.whole_sequences),
the way the engine prefills them."""

from __future__ import annotations

import torch

from moe_serve.layers.batch import ForwardBatch
from moe_serve.models import MoETransformer

TOKENS_PER_FORWARD = 4096  # texts are packed into forwards of about this many tokens (bounds the [T, V] logits)


@torch.no_grad()
def kl_from_reference(
    reference: MoETransformer, candidates: dict[str, MoETransformer], token_ids: list[list[int]], k: int
) -> dict[str, float]:
    """Each candidate's mean KL(reference || candidate) over every position that predicts a token of its
    text, at k: the texts go through the models a group at a time, so only one group's logits are held."""
    total = dict.fromkeys(candidates, 0.0)
    positions = 0
    for group in _groups(token_ids):
        expected = _log_probs(reference, group, k)
        positions += expected.shape[0]
        for name, model in candidates.items():
            got = _log_probs(model, group, k)
            total[name] += float((expected.exp() * (expected - got)).sum())
    return {name: value / max(positions, 1) for name, value in total.items()}


def _log_probs(model: MoETransformer, group: list[list[int]], k: int) -> torch.Tensor:
    """Next-token log-probabilities [P, V] fp32 at every position but each text's last (it predicts nothing)."""
    device = model.embed_tokens.weight.device
    lengths = [len(ids) for ids in group]
    batch = ForwardBatch.whole_sequences(lengths, [k] * len(group), device)
    ids = torch.tensor([t for ids in group for t in ids], device=device)
    hidden = model(ids, batch)  # [T, D]
    keep = torch.ones(len(ids), dtype=torch.bool, device=device)
    keep[torch.tensor(lengths, device=device).cumsum(0) - 1] = False
    return torch.log_softmax(model.lm_logits(hidden[keep]), dim=-1)


def _groups(token_ids: list[list[int]]) -> list[list[list[int]]]:
    groups: list[list[list[int]]] = [[]]
    for ids in token_ids:
        if groups[-1] and sum(map(len, groups[-1])) + len(ids) > TOKENS_PER_FORWARD:
            groups.append([])
        groups[-1].append(ids)
    return [g for g in groups if g]
