"""Multi-head latent attention (MLA: DeepSeek-V2/V3; ModelConfig.latent_attention) over a token-packed batch.

Legend: T tokens of the step, H heads, N nope dims, P rope dims, V value dims per head, R kv_lora_rank,
C = R + P, D hidden.

What transformers computes per head h (keys and values decompressed from the latent c of each key token):

    score_h(i, j) = scale * (q_nope_h(i) . (Wuk_h c_j) + q_pe_h(i) . k_pe_j),   out_h(i) = sum_j p_h(i, j) Wuv_h c_j

is served in the absorbed form, which is the same sum regrouped:

    score_h(i, j) = scale * ([Wuk_h^T q_nope_h(i), q_pe_h(i)] . [c_j, k_pe_j]),  out_h(i) = Wuv_h (sum_j p_h(i, j) c_j)

so the only per-key data is [c_j, k_pe_j], shared by every head: the cache keeps those C values per token per
layer (kernels.latent), never per-head keys and values, and one code path serves prefill, chunked prefill,
prefix-cache hits and decode. Wuk and Wuv are the rows of kv_b_proj, per head. The projections go through
ops.linear (the C++ kernels on the CPU; packed weights too, except kv_b_proj, which is read as Wuk / Wuv).

Rotary applies to the P rope dims only, rotate-half style: DeepSeek's interleaved pairs are de-interleaved in
the rows of the q and kv_a projections at export (exporters/hf/deepseek.py), which leaves every q . k unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_serve.kernels import ops
from moe_serve.kernels.latent import LatentCache, write_latent
from moe_serve.kernels.vocabulary import AttentionBatch, float_weight
from moe_serve.layers.batch import ForwardBatch
from moe_serve.layers.norm import RMSNorm
from moe_serve.layers.positions import apply_rotary, rotary_tables
from moe_serve.model_config import ModelConfig


class LatentAttention(nn.Module):
    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        """index: the layer's (every layer of a latent-attention model attends alike)."""
        super().__init__()
        mla = config.latent_attention
        assert mla is not None, "LatentAttention needs ModelConfig.latent_attention"
        d, h = config.hidden_size, config.num_heads
        self.config = config
        self.num_heads, self.rank = h, mla.kv_lora_rank
        self.nope, self.rope, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        q_out = h * (self.nope + self.rope)
        self.scale = config.attention_scale if config.attention_scale is not None else (self.nope + self.rope) ** -0.5
        # DeepSeek's attention_bias puts a bias on q_a, kv_a and o, never on q_proj / q_b_proj or kv_b_proj.
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(d, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, mla.q_lora_rank, bias=config.attention_bias)
            self.q_a_norm = RMSNorm(mla.q_lora_rank, mla.norm_eps)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_out, bias=False)
        self.kv_a_proj = nn.Linear(d, mla.cache_width, bias=config.attention_bias)
        self.kv_a_norm = RMSNorm(mla.kv_lora_rank, mla.norm_eps)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=config.attention_out_bias)
        self.is_causal = True
        # Computed by prepare() after the weights are loaded.
        self._rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [positions, P]
        self._w_uk: torch.Tensor | None = None  # [H, R, N]: each head's key map, transposed (ops.head_linear's rows)
        self._w_uv: torch.Tensor | None = None  # [H, V, R]

    @torch.no_grad()
    def prepare(self) -> None:
        """The position tables for every position the context allows, and kv_b_proj's rows split per head."""
        weight = float_weight(self.kv_b_proj.weight, self.kv_b_proj.weight.dtype)
        per_head = weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        self._w_uk = per_head[:, : self.nope].transpose(1, 2).contiguous()
        self._w_uv = per_head[:, self.nope :].contiguous()
        config = self.config
        self._rotary = rotary_tables(
            config.max_position_embeddings, self.rope, config.rope_theta, config.rope_scaling, None, weight.device
        )

    def forward(self, x: torch.Tensor, batch: ForwardBatch, layer: int) -> torch.Tensor:
        """x [T, D] -> [T, D]; this step's latents go into the layer's cache when there is one."""
        if self._rotary is None:
            self.prepare()
        assert self._rotary is not None and self._w_uk is not None and self._w_uv is not None
        attention = batch.attention
        if not isinstance(attention, AttentionBatch):  # the ONNX export refuses these models first
            raise NotImplementedError("multi-head latent attention runs on the engine's packed batches only")
        t, h = x.shape[0], self.num_heads
        if hasattr(self, "q_proj"):
            q = ops.linear(x, self.q_proj.weight)
        else:
            q = ops.linear(self.q_a_norm(ops.linear(x, self.q_a_proj.weight, self.q_a_proj.bias)), self.q_b_proj.weight)
        q_nope, q_pe = q.view(t, h, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        kv = ops.linear(x, self.kv_a_proj.weight, self.kv_a_proj.bias)  # [T, C]
        c = self.kv_a_norm(kv[:, : self.rank].contiguous())  # [T, R]
        positions = attention.positions
        cos, sin = self._rotary[0][positions], self._rotary[1][positions]  # [T, P]
        q_pe = apply_rotary(q_pe, cos, sin)  # [T, H, P]
        k_pe = apply_rotary(kv[:, None, self.rank :], cos, sin)[:, 0]  # [T, P]
        latent = torch.cat([c, k_pe.to(c.dtype)], dim=-1)  # [T, C]
        cache = batch.latent_caches[layer] if batch.latent_caches is not None else None
        if cache is not None:
            assert attention.slot_mapping is not None
            write_latent(cache, latent, attention.slot_mapping)
        q_latent = ops.head_linear(q_nope.contiguous(), self._w_uk)  # [T, H, R]
        query = torch.cat([q_latent, q_pe.to(q_latent.dtype)], dim=-1)  # [T, H, C]
        context = ops.latent_attention(query, latent, attention, cache, self.rank, self.scale)  # [T, H, R]
        out = ops.head_linear(context, self._w_uv).reshape(t, h * self.v_dim)
        return ops.linear(out, self.o_proj.weight, self.o_proj.bias)


__all__ = ["LatentAttention", "LatentCache"]
