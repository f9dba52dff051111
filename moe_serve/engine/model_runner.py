"""Turns lists of token ids into padded tensors and a BatchLayout, and runs the model.

Legend: B sequences, L longest new-token run in the batch, D hidden.
"""

from __future__ import annotations

import torch

from moe_serve.engine.kv_cache import KVCache
from moe_serve.layers.attention import BatchLayout
from moe_serve.models import MoETransformer


class ModelRunner:
    def __init__(self, model: MoETransformer, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.config = model.config

    @torch.inference_mode()
    def forward(
        self,
        token_ids: list[list[int]],  # new tokens of each sequence
        experts_per_token: list[int],  # k of each sequence (ignored by a dense model)
        *,
        start_positions: list[int] | None = None,  # tokens already cached per sequence
        slots: list[int] | None = None,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> hidden states [B, L, D] and the token mask [B, L] (True for real tokens)."""
        b, l = len(token_ids), max(len(t) for t in token_ids)
        lengths = torch.tensor([len(t) for t in token_ids])
        ids = torch.zeros(b, l, dtype=torch.long)
        for row, tokens in enumerate(token_ids):
            ids[row, : len(tokens)] = torch.tensor(tokens)
        token_mask = torch.arange(l)[None, :] < lengths[:, None]  # [B, L]
        start = torch.tensor(start_positions or [0] * b)
        positions = (start[:, None] + torch.arange(l)[None, :]) * token_mask  # [B, L]
        layout_kwargs = {}
        if cache is not None:
            assert slots is not None
            context_lens = start + lengths
            cache.ensure_length(int(context_lens.max()))
            layout_kwargs = dict(
                slot_ids=torch.tensor(slots, device=self.device),
                context_lens=context_lens.to(self.device),
                max_context_len=int(context_lens.max()),
                first_slot=slots[0] if slots == list(range(slots[0], slots[0] + b)) else None,
            )
        layout = BatchLayout(
            positions=positions.to(self.device), token_mask=token_mask.to(self.device), **layout_kwargs
        )
        top_k = torch.tensor(experts_per_token, device=self.device)
        hidden = self.model(
            ids.to(self.device), layout, top_k, max(experts_per_token), None if cache is None else cache.layers
        )
        return hidden, layout.token_mask

    def last_token_logits(self, hidden: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
        """[B, L, D] -> logits of each sequence's last real token [B, V]."""
        last = token_mask.long().sum(1) - 1
        return self.model.lm_logits(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])
