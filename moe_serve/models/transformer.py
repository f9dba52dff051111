"""The MoE transformer described by a ModelConfig: decoder-only causal LM or bidirectional encoder with a
pooler and classification head. Per-layer dense FFN or MoE block; pre- or post-norm. Every forward runs
on a token-packed batch: the tokens of all sequences of a step in one [T, D] tensor, no padding.

Legend: T tokens of the step, S sequences, D hidden, V vocabulary, C classes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from moe_serve.kernels import ops
from moe_serve.kernels.vocabulary import Weight
from moe_serve.layers.attention import Attention
from moe_serve.layers.batch import AttentionInputs, ForwardBatch
from moe_serve.layers.ffn import FFN
from moe_serve.layers.latent_attention import LatentAttention
from moe_serve.layers.moe import MoEBlock
from moe_serve.layers.norm import make_norm
from moe_serve.model_config import ModelConfig


def _attention(config: ModelConfig, index: int) -> Attention | LatentAttention:
    """Layer `index`'s attention: multi-head latent attention when the config has it (DeepSeek), else q/k/v."""
    return LatentAttention(config, index) if config.latent_attention is not None else Attention(config, index)


class DecoderLayer(nn.Module):
    moe: MoEBlock  # MoE layers
    ffn: FFN  # dense layers

    def __init__(self, config: ModelConfig, index: int, attention: Attention | None = None) -> None:
        """attention: another runtime's attention for this layer (the vLLM plugin's); default moe-serve's."""
        super().__init__()
        self.index = index
        self.is_pre_norm = config.norm_position == "pre"
        self.residual_scale = config.residual_scale
        self.attn_norm = make_norm(config.norm, config.hidden_size, config.norm_eps)
        self.attn: Attention | LatentAttention = attention if attention is not None else _attention(config, index)
        self.ffn_norm = make_norm(config.norm, config.hidden_size, config.norm_eps)
        self.is_moe = config.is_moe_layer(index)
        if self.is_moe:
            assert config.moe is not None
            self.moe = MoEBlock(config.moe, config.hidden_size, config.norm_eps)
        else:
            self.ffn = FFN(config.ffn, config.hidden_size)

    def _ffn(self, x: torch.Tensor, batch: ForwardBatch, attention: AttentionInputs | None) -> torch.Tensor:
        return self.moe(x, batch, self.index, attention) if self.is_moe else self.ffn(x)

    def _attn(self, x: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, AttentionInputs | None]:
        if self.is_moe and self.moe.router_kind.reads_attention:
            assert isinstance(self.attn, Attention)  # ModelConfig refuses such a kind with latent attention
            return self.attn.forward_with_inputs(x, batch, self.index)
        return self.attn(x, batch, self.index), None

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """h [T, D] -> [T, D]."""
        if self.is_pre_norm:
            out, attention = self._attn(self.attn_norm(h), batch)
            h = h + self._scaled(out)
            return h + self._scaled(self._ffn(self.ffn_norm(h), batch, attention))
        out, attention = self._attn(h, batch)
        h = self.attn_norm(h + self._scaled(out))
        return self.ffn_norm(h + self._scaled(self._ffn(h, batch, attention)))

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        """A branch's output as it joins the residual stream (ModelConfig.residual_scale; Granite's multiplier)."""
        return branch * self.residual_scale if self.residual_scale != 1.0 else branch


class MoETransformer(nn.Module):
    def __init__(
        self, config: ModelConfig, make_layer: Callable[[ModelConfig, int], DecoderLayer] = DecoderLayer
    ) -> None:
        """make_layer(config, index): each decoder layer (another runtime's, say, with its own attention)."""
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(config, i) for i in range(config.num_layers))
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

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return cast(list[DecoderLayer], list(self.layers))

    @torch.no_grad()
    def prepare(self) -> None:
        """After the weights are loaded: fused projections and position tables (see Attention.prepare)."""
        for layer in self.decoder_layers:
            layer.attn.prepare()
            if layer.is_moe:
                layer.moe.prepare()

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, D]."""
        h = self.inputs(input_ids, batch)
        if batch.decode_stack is not None and batch.decode_stack.accepts(batch):  # engine.decode_stack
            h = batch.decode_stack(h, batch)
        else:
            for layer in self.layers:
                h = layer(h, batch)
        if self.config.final_norm:
            h = self.norm(h)
        return h

    def inputs(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids [T] -> the first layer's input [T, D]: the token embeddings, plus learned positions."""
        h = self.embed(input_ids)
        if self.config.position == "learned":
            h = h + self.embed_positions(batch.attention.positions)
        return h

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the scaled token embeddings [T, D] (learned positions are added in forward)."""
        h = self.embed_tokens(input_ids)
        return h * self.config.embedding_scale if self.config.embedding_scale != 1.0 else h

    def track_expert_load(self) -> None:
        """Start counting tokens per expert in every MoE layer (read with `read_expert_load`)."""
        for layer in self.decoder_layers:
            if layer.is_moe:
                layer.moe.expert_load = torch.zeros(
                    layer.moe.config.num_experts, dtype=torch.int64, device=self.embed_tokens.weight.device
                )

    def read_expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert per MoE layer since the last read; resets the counts."""
        loads = {}
        for i, layer in enumerate(self.decoder_layers):
            if layer.is_moe and layer.moe.expert_load is not None:
                loads[i] = layer.moe.expert_load.tolist()
                layer.moe.expert_load.zero_()
        return loads

    def lm_head_weights(self) -> tuple[Weight, torch.Tensor | None]:
        """The LM head's weight (the token embeddings where they are tied) and bias."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.weight, self.lm_head_bias if self.config.lm_head_bias else None
        return self.lm_head.weight, self.lm_head.bias

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, D] -> [R, V] in fp32 (divided by ModelConfig.logits_divisor, Granite's logits_scaling)."""
        logits = ops.linear(hidden, *self.lm_head_weights()).float()
        divisor = self.config.logits_divisor
        return logits / divisor if divisor != 1.0 else logits

    def class_logits(self, hidden: torch.Tensor, seq_lens: tuple[int, ...]) -> torch.Tensor:
        """hidden [T, D] of whole sequences of seq_lens tokens -> [S, C] in fp32."""
        assert self.config.classifier is not None
        pooling = self.config.classifier.pooling
        parts = hidden.split(seq_lens)
        if pooling == "mean":
            pooled = torch.stack([part.mean(0) for part in parts])
        else:
            pooled = torch.stack([part[0] if pooling == "first" else part[-1] for part in parts])
        return self.classify(pooled)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """Each input's pooled hidden state [S, D] -> class logits [S, C] in fp32."""
        assert self.config.classifier is not None
        if self.config.classifier.pooler_dense:
            pooled = torch.tanh(self.pooler(pooled))
        return self.classifier(pooled).float()
