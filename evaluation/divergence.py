"""How far packed weights (or rounded activations) move a language model: the mean KL divergence
KL(p_reference || p_candidate) of next-token distributions, in nats per scored token, and how often its
routers still choose the same experts (the top-k set agreement per MoE layer), at a given k. Both models run
the same whole texts in one reference forward each (no cache, sequences packed;
moe_serve.layers.batch.ForwardBatch.whole_sequences), the way the engine prefills them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from moe_serve.layers.batch import ForwardBatch
from moe_serve.layers.moe import MoEBlock
from moe_serve.models import MoETransformer

TOKENS_PER_FORWARD = 4096  # texts are packed into forwards of about this many tokens (bounds the [T, V] logits)


@dataclass(frozen=True, slots=True)
class Divergence:
    kl: float  # mean KL(reference || candidate), nats per scored token
    # per MoE layer, in model order: the mean over routed rows of |S_ref & S_candidate| / |S_ref|, S the experts
    # a row's router chose (1.0: the same experts everywhere)
    topk_agreement: list[float]


@torch.no_grad()
def divergence_from_reference(
    reference: MoETransformer, candidates: dict[str, MoETransformer], token_ids: list[list[int]], k: int
) -> dict[str, Divergence]:
    """Each candidate's Divergence from the reference over every position that predicts a token of its text,
    at k: the texts go through the models a group at a time, so only one group's logits are held."""
    kl = dict.fromkeys(candidates, 0.0)
    agreed: dict[str, torch.Tensor] = {}
    routed: torch.Tensor | None = None
    positions = 0
    for group in _groups(token_ids):
        expected, reference_routes = _log_probs(reference, group, k)
        positions += expected.shape[0]
        counts = torch.tensor([float((ids >= 0).sum()) for ids in reference_routes])
        routed = counts if routed is None else routed + counts
        for name, model in candidates.items():
            got, routes = _log_probs(model, group, k)
            kl[name] += float((expected.exp() * (expected - got)).sum())
            same = torch.tensor([_same_experts(a, b) for a, b in zip(reference_routes, routes, strict=True)])
            agreed[name] = agreed[name] + same if name in agreed else same
    return {
        name: Divergence(
            kl[name] / max(positions, 1), (agreed[name] / routed.clamp(min=1)).tolist() if routed is not None else []
        )
        for name in candidates
    }


def _same_experts(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """Slots of `reference` [R, K] (-1: unused) whose expert is among the same row's in `candidate`."""
    hits = (reference[:, :, None] == candidate[:, None, :]).any(-1) & (reference >= 0)
    return float(hits.sum())


@contextmanager
def _recorded_routes(model: MoETransformer) -> Iterator[list[list[torch.Tensor]]]:
    """The top-k ids [R, K] each MoE layer's router chose in the forwards run inside, per layer in model order
    (MoEBlock._count sees every routing decision)."""
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    routes: list[list[torch.Tensor]] = [[] for _ in blocks]
    for block, record in zip(blocks, routes, strict=True):
        count = block._count

        def recording(topk_ids, batch, tokens_per_row=None, count=count, record=record):  # noqa: ANN001, ANN202
            record.append(topk_ids.clone())
            count(topk_ids, batch, tokens_per_row)

        block._count = recording  # type: ignore[method-assign]
    try:
        yield routes
    finally:
        for block in blocks:
            del block._count


def _log_probs(model: MoETransformer, group: list[list[int]], k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Next-token log-probabilities [P, V] fp32 at every position but each text's last (it predicts nothing),
    and each MoE layer's routing decisions [R, K] for the whole group."""
    device = model.embed_tokens.weight.device
    lengths = [len(ids) for ids in group]
    batch = ForwardBatch.whole_sequences(lengths, [k] * len(group), device)
    ids = torch.tensor([t for ids in group for t in ids], device=device)
    with _recorded_routes(model) as routes:
        hidden = model(ids, batch)  # [T, D]
    keep = torch.ones(len(ids), dtype=torch.bool, device=device)
    keep[torch.tensor(lengths, device=device).cumsum(0) - 1] = False
    return torch.log_softmax(model.lm_logits(hidden[keep]), dim=-1), [torch.cat(r) for r in routes if r]


def _groups(token_ids: list[list[int]]) -> list[list[list[int]]]:
    groups: list[list[list[int]]] = [[]]
    for ids in token_ids:
        if groups[-1] and sum(map(len, groups[-1])) + len(ids) > TOKENS_PER_FORWARD:
            groups.append([])
        groups[-1].append(ids)
    return [g for g in groups if g]
