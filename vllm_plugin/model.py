"""A moe-serve causal LM as a vLLM model: vLLM's paged attention, moe-serve's own norms, rotary tables, FFNs
and MoE block (every stateless router kind and expert kind), parameters under the artifact's own tensor
names. Each token's k comes from `experts_per_token`, which the worker fills before every step.

Legend: T tokens of the step, H query heads, G key/value heads, Dh head dim, D hidden, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention

from moe_serve.kernels import ops
from moe_serve.layers.batch import ForwardBatch
from moe_serve.layers.norm import RMSNorm, make_norm
from moe_serve.layers.positions import rotary_cos_sin
from moe_serve.model_config import ModelConfig
from moe_serve.models.transformer import DecoderLayer


class MoeServeAttention(nn.Module):
    """moe-serve's attention math (moe_serve.layers.attention) with vLLM's Attention holding the keys and
    values in vLLM's paged cache."""

    def __init__(self, config: ModelConfig, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        d, h, g, dh = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        assert g is not None and dh is not None
        self.config = config
        self.num_heads, self.num_kv_heads, self.head_dim = h, g, dh
        self.q_proj = nn.Linear(d, h * dh, bias=config.attention_bias)
        self.k_proj = nn.Linear(d, g * dh, bias=config.attention_bias)
        self.v_proj = nn.Linear(d, g * dh, bias=config.attention_bias)
        self.o_proj = nn.Linear(h * dh, d, bias=config.attention_out_bias)
        if config.qk_norm is not None:
            q_dim, k_dim = (dh, dh) if config.qk_norm == "per_head" else (h * dh, g * dh)
            self.q_norm = RMSNorm(q_dim, config.norm_eps)
            self.k_norm = RMSNorm(k_dim, config.norm_eps)
        self.attn = Attention(
            h, dh, dh**-0.5, num_kv_heads=g, cache_config=vllm_config.cache_config, prefix=f"{prefix}.attn"
        )
        self._rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [P, Dh] fp32, after loading

    def prepare(self) -> None:
        positions = torch.arange(self.config.max_position_embeddings, device=self.q_proj.weight.device)
        self._rotary = rotary_cos_sin(positions, self.head_dim, self.config.rope_theta, self.config.rope_scaling)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t, h, g, dh = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = ops.linear(x, self.q_proj.weight, self.q_proj.bias)
        k = ops.linear(x, self.k_proj.weight, self.k_proj.bias)
        v = ops.linear(x, self.v_proj.weight, self.v_proj.bias)
        if self.config.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.config.qkv_clip is not None:
            q, k, v = (y.clamp(-self.config.qkv_clip, self.config.qkv_clip) for y in (q, k, v))
        q, k, v = q.reshape(t, h, dh), k.reshape(t, g, dh), v.reshape(t, g, dh)
        if self.config.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        assert self._rotary is not None, "load_weights prepares the rotary tables"
        q, k = ops.rotary_write(q, k, v, (self._rotary[0][positions], self._rotary[1][positions]), None, None)
        out = self.attn(q.reshape(t, h * dh), k.reshape(t, g * dh), v.reshape(t, g * dh).contiguous())
        return ops.linear(out.reshape(t, h * dh), self.o_proj.weight, self.o_proj.bias)


@dataclass(frozen=True, slots=True)
class VllmBatch(ForwardBatch):
    """moe-serve's batch (each token's k) with vLLM's positions, which the plugin's attention reads."""

    positions: torch.Tensor | None = None


class MoeServeDecoderLayer(DecoderLayer):
    """moe-serve's decoder layer (norms, FFN or MoE block, pre/post norm) around vLLM's attention."""

    def __init__(self, config: ModelConfig, index: int, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__(config, index, attention=MoeServeAttention(config, vllm_config, f"{prefix}.attn"))

    def _attn(self, x: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, None]:
        assert isinstance(batch, VllmBatch)
        return self.attn(batch.positions, x), None


class MoeServeForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config: ModelConfig = vllm_config.model_config.hf_config.model_config
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            MoeServeDecoderLayer(config, i, vllm_config, f"{prefix}layers.{i}") for i in range(config.num_layers)
        )
        if config.final_norm:
            self.norm = make_norm(config.norm, config.hidden_size, config.norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
        elif config.lm_head_bias:
            self.lm_head_bias = nn.Parameter(torch.zeros(config.vocab_size))
        moe = config.moe
        self.default_k = moe.default_k if moe is not None else 1
        self.min_k = moe.min_k if moe is not None else 1
        self.max_k = moe.max_k if moe is not None else 1
        # Each token's k for the step being run (the worker writes the first T entries before each step);
        # a dummy step (vLLM's profiling and warm-up) runs at the default k.
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.experts_per_token = torch.full((max_tokens,), self.default_k, dtype=torch.int64)

    def set_experts_per_token(self, per_token: np.ndarray) -> None:
        self.experts_per_token[: len(per_token)].copy_(torch.from_numpy(per_token))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        return h * self.config.embedding_scale if self.config.embedding_scale != 1.0 else h

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: object = None,
        inputs_embeds: torch.Tensor | None = None,
        **_: object,
    ) -> torch.Tensor:
        h = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        t = h.shape[0]
        # The MoE blocks of stateless routers read only top_k and max_k; max_k is the artifact's largest k,
        # so the shapes never depend on the step's requests. Slots beyond a token's own k are id -1, never computed.
        top_k = self.experts_per_token[:t].to(h.device)
        batch = VllmBatch(attention=None, top_k=top_k, max_k=self.max_k, positions=positions)  # type: ignore[arg-type]
        for layer in self.layers:
            h = layer(h, batch)
        return self.norm(h) if self.config.final_norm else h

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """As moe_serve.models.transformer.MoETransformer.lm_logits (fp32)."""
        if self.config.tie_word_embeddings:
            bias = self.lm_head_bias if self.config.lm_head_bias else None
            return ops.linear(hidden_states, self.embed_tokens.weight, bias).float()
        return ops.linear(hidden_states, self.lm_head.weight, self.lm_head.bias).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The artifact's tensors under their own names (moe_serve.artifact checked them at export)."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                raise ValueError(f"model.safetensors has tensor '{name}', which this model does not have")
            with torch.no_grad():
                params[name].copy_(tensor.to(params[name].dtype))
            loaded.add(name)
        for layer in self.layers:
            layer.attn.prepare()
            if layer.is_moe:
                layer.moe.prepare()
        return loaded
