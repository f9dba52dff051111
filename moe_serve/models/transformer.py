"""The MoE transformer described by a ModelConfig: decoder-only causal LM or bidirectional encoder with a
pooler and classification head. Per-layer dense FFN or MoE block; pre- or post-norm.

Legend: B sequences, L tokens per sequence (right-padded), D hidden, V vocabulary, C classes.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_serve.layers.attention import Attention, BatchLayout
from moe_serve.layers.ffn import FFN
from moe_serve.layers.moe import MoEBlock
from moe_serve.layers.norm import make_norm
from moe_serve.model_config import ModelConfig

KVCacheLayer = tuple[torch.Tensor, torch.Tensor]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.is_pre_norm = config.norm_position == "pre"
        self.attn_norm = make_norm(config.norm, config.hidden_size, config.norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = make_norm(config.norm, config.hidden_size, config.norm_eps)
        self.is_moe = config.is_moe_layer(index)
        if self.is_moe:
            assert config.moe is not None
            self.moe = MoEBlock(config.moe, config.hidden_size, config.norm_eps)
        else:
            self.ffn = FFN(config.ffn, config.hidden_size)

    def _ffn(self, x: torch.Tensor, layout: BatchLayout, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
        if self.is_moe:
            return self.moe(x, layout.token_mask, top_k, max_k)
        return self.ffn(x)

    def forward(
        self,
        h: torch.Tensor,  # [B, L, D]
        layout: BatchLayout,
        top_k: torch.Tensor,  # [B]
        max_k: int,
        kv_cache: KVCacheLayer | None,
    ) -> torch.Tensor:
        if self.is_pre_norm:
            h = h + self.attn(self.attn_norm(h), layout, kv_cache)
            return h + self._ffn(self.ffn_norm(h), layout, top_k, max_k)
        h = self.attn_norm(h + self.attn(h, layout, kv_cache))
        return self.ffn_norm(h + self._ffn(h, layout, top_k, max_k))


class MoETransformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        if config.final_norm:
            self.norm = make_norm(config.norm, config.hidden_size, config.norm_eps)
        if config.task == "causal_lm":
            if not config.tie_word_embeddings:
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
            elif config.lm_head_bias:
                self.lm_head_bias = nn.Parameter(torch.zeros(config.vocab_size))
        else:
            assert config.classifier is not None
            if config.classifier.pooler_dense:
                self.pooler = nn.Linear(config.hidden_size, config.hidden_size)
            self.classifier = nn.Linear(config.hidden_size, len(config.classifier.labels))

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, L]
        layout: BatchLayout,
        top_k: torch.Tensor,  # [B] experts per token of each sequence (ignored by dense layers)
        max_k: int,
        kv_cache: list[KVCacheLayer] | None = None,
    ) -> torch.Tensor:
        """Final hidden states [B, L, D]."""
        h = self.embed_tokens(input_ids)
        if self.config.embedding_scale != 1.0:
            h = h * self.config.embedding_scale
        if self.config.position == "learned":
            h = h + self.embed_positions(layout.positions)
        for i, layer in enumerate(self.layers):
            h = layer(h, layout, top_k, max_k, None if kv_cache is None else kv_cache[i])
        if self.config.final_norm:
            h = self.norm(h)
        return h

    def track_expert_load(self) -> None:
        """Start counting tokens per expert in every MoE layer (read with `read_expert_load`)."""
        for layer in self.layers:
            if layer.is_moe:
                layer.moe.expert_load = torch.zeros(
                    layer.moe.config.num_experts, dtype=torch.int64, device=self.embed_tokens.weight.device
                )

    def read_expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert per MoE layer since the last read; resets the counts."""
        loads = {}
        for i, layer in enumerate(self.layers):
            if layer.is_moe and layer.moe.expert_load is not None:
                loads[i] = layer.moe.expert_load.tolist()
                layer.moe.expert_load.zero_()
        return loads

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., D] -> [..., V] in fp32."""
        if self.config.tie_word_embeddings:
            logits = hidden @ self.embed_tokens.weight.T
            if self.config.lm_head_bias:
                logits = logits + self.lm_head_bias
            return logits.float()
        return self.lm_head(hidden).float()

    def class_logits(self, hidden: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
        """[B, L, D] -> [B, C] in fp32, pooled over real tokens only."""
        assert self.config.classifier is not None
        pooling = self.config.classifier.pooling
        if pooling == "mean":
            mask = token_mask[..., None].to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        elif pooling == "first":
            pooled = hidden[:, 0]
        else:
            last = token_mask.long().sum(1) - 1  # [B]
            pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        if self.config.classifier.pooler_dense:
            pooled = torch.tanh(self.pooler(pooled))
        return self.classifier(pooled).float()
