"""The artifact's network as a module that `torch.onnx.export` can trace: the model's own layers
(moe_serve.models, moe_serve.layers) run on a padded batch with the kernels' graph family
(moe_serve.kernels.graph), so the export and the engine share one spelling of the embeddings, attention,
norms, the MoE block and its router kinds (docs/architecture.md §7).

What is written here is only the graph's interface: padded [B, T] inputs with an attention mask, k per
row as a tensor, past and present keys and values per layer, and the heads' pooling of padded rows.

Legend: B rows, T new tokens per row, P past tokens, S = P + T keys, G key/value heads, Dh head dim, D
hidden, N experts, M = B * T token rows, C classes, V vocabulary.

Experts per row: a token router takes the top K = max k slots of every token (ties go to the lower
index), slots at or beyond the row's own k get weight 0, and each expert runs only on the token slots
routed to it: a slot beyond a row's k is never computed, so the expert cost follows the sum of the rows'
k. A per-sequence kind decides once per row from its masked mean; soft_merge merges the K slots'
parameters (weight 0 beyond k).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_serve.kernels.graph import GraphCache, PaddedBatch
from moe_serve.layers.batch import ForwardBatch
from moe_serve.models import MoETransformer


class GraphModel(nn.Module):
    """What both task graphs share: the model's forward over a padded batch with an optional past. `model`
    is a loaded fp32 artifact model (after prepare())."""

    def __init__(self, model: MoETransformer) -> None:
        super().__init__()
        self.model = model
        self.config = config = model.config
        self.max_k = config.moe.max_k if config.moe is not None else 0

    def layers(
        self,
        input_ids: torch.Tensor,  # [B, T]
        key_mask: torch.Tensor,  # [B, S] int64, 1 for real tokens (past included)
        experts_per_token: torch.Tensor,  # [B] int64
        pasts: list[tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None, PaddedBatch]:
        """-> final hidden states [M, D], each layer's keys and values so far, the tokens routed to each
        expert per MoE layer in this run ([L_moe, N] int64; None without MoE layers), and the batch."""
        t = input_ids.shape[1]
        rows = PaddedBatch.build(key_mask, t, self.config.is_causal)
        token_k = (experts_per_token[:, None] * rows.token_mask.long()).reshape(-1)  # padding: k = 0, no experts
        caches = [GraphCache(past) for past in pasts] if pasts is not None else None
        batch = ForwardBatch(rows, token_k, self.max_k, kv_caches=caches, row_k=experts_per_token, expert_counts=[])
        hidden = self.model(input_ids.reshape(-1), batch)  # [M, D]
        presents = [cache.present for cache in caches] if caches is not None else []
        assert batch.expert_counts is not None and all(present is not None for present in presents)
        counts = torch.stack(batch.expert_counts) if batch.expert_counts else None
        return hidden, presents, counts, rows  # type: ignore[return-value]  # presents: each set by its layer


class CausalLMGraph(GraphModel):
    """(input_ids [B, T], attention_mask [B, P + T], experts_per_token [B], past key/value per layer
    [B, G, P, Dh]) -> (logits [B, T, V], present key/value per layer [B, G, P + T, Dh], and with MoE
    layers expert_counts [L_moe, N]).

    One graph for prefill (P = 0) and decode (T = 1). attention_mask covers the past and the new tokens;
    rows may be left-padded (positions count real tokens only)."""

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, experts_per_token: torch.Tensor, *past
    ) -> tuple[torch.Tensor, ...]:
        pasts = [(past[2 * i], past[2 * i + 1]) for i in range(self.config.num_layers)]
        hidden, presents, counts, _ = self.layers(input_ids, attention_mask, experts_per_token, pasts)
        logits = self.model.lm_logits(hidden).reshape(input_ids.shape[0], input_ids.shape[1], -1)
        outputs = (logits, *(t for present in presents for t in present))
        return outputs if counts is None else (*outputs, counts)


class ClassifierGraph(GraphModel):
    """(input_ids [B, T], attention_mask [B, T], experts_per_token [B]) -> (logits [B, C], probs [B, C], and
    with MoE layers expert_counts [L_moe, N])."""

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, experts_per_token: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        hidden, _, counts, _ = self.layers(input_ids, attention_mask, experts_per_token, None)
        hidden = hidden.reshape(input_ids.shape[0], input_ids.shape[1], -1)  # [B, T, D]
        logits = self.model.classify(self._pool(hidden, attention_mask.float()))
        outputs = (logits, torch.softmax(logits, dim=-1))
        return outputs if counts is None else (*outputs, counts)

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The classifier's pooling of padded rows: [B, T, D] -> [B, D] (MoETransformer.class_logits pools
        packed sequences by their lengths, which a graph does not have)."""
        classifier = self.config.classifier
        assert classifier is not None
        if classifier.pooling == "mean":
            return (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        positions = torch.arange(mask.shape[1], device=hidden.device)[None, :]
        # float: onnxruntime's ArgMax takes no int64 (the first maximum wins in both).
        index = torch.argmax(mask if classifier.pooling == "first" else mask * positions, dim=1)
        return torch.gather(hidden, 1, index[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]


__all__ = ["CausalLMGraph", "ClassifierGraph", "GraphModel"]
