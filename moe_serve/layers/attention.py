"""Multi-head attention for every position kind over a token-packed batch (no padding between sequences).

Legend: T tokens of the step (all sequences, packed), H query heads, G key/value heads, Dh head dim,
D hidden size, R relative distances.

With a KV cache, a token's keys and values are written to its slot in the paged cache and each query reads
its own sequence's blocks, so prefill, chunked prefill, a prefix-cache hit and decode are one code path.
Transformer-XL relative attention is served from the same cache: its positional term only needs the
distance between query and key positions (a table of every distance, computed once).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_serve.kernels import hugepages, ops
from moe_serve.kernels.graph import GraphCache
from moe_serve.kernels.packed import PackedWeight
from moe_serve.kernels.vocabulary import RelativeTerm, log1p
from moe_serve.layers.batch import AttentionInputs, ForwardBatch
from moe_serve.layers.norm import RMSNorm
from moe_serve.layers.positions import rotary_tables, sinusoid_relative
from moe_serve.model_config import AttentionTemperature, ModelConfig


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        """index: the layer's, for what differs by layer (ModelConfig.layer_attention)."""
        super().__init__()
        d, h, g, dh = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        assert h is not None and g is not None and dh is not None
        self.num_heads, self.num_kv_heads, self.head_dim = h, g, dh
        self.is_causal = config.is_causal
        span = config.attention_of(index)
        self.window, self.chunk = span.window, span.chunk
        self.position = config.position if span.rotary else "none"  # a NoPE layer of a rotary model
        self.config = config
        self.qkv_clip = config.qkv_clip
        self.scale = config.attention_scale if config.attention_scale is not None else dh**-0.5
        self.q_proj = nn.Linear(d, h * dh, bias=config.attention_bias)
        self.k_proj = nn.Linear(d, g * dh, bias=config.attention_bias)
        self.v_proj = nn.Linear(d, g * dh, bias=config.attention_bias)
        self.o_proj = nn.Linear(h * dh, d, bias=config.attention_out_bias)
        if config.attention_sinks:  # gpt-oss: one logit per query head beside every softmax's scores
            self.sinks = nn.Parameter(torch.zeros(h))
        self.qk_norm = config.qk_norm if span.qk_norm else None
        # Llama 4: the queries of its layers without rotary are scaled up with their position
        self.temperature = config.attention_temperature if not span.rotary else None
        if self.qk_norm is not None:
            # per_head: one RMSNorm over each head's Dh (Qwen3-MoE); full: over all heads at once (OLMoE).
            q_dim, k_dim = (dh, dh) if config.qk_norm == "per_head" else (h * dh, g * dh)
            # nn.Module: the vLLM plugin swaps in a norm over its rank's heads (vllm_plugin.model.ShardedRMSNorm).
            self.q_norm: nn.Module = RMSNorm(q_dim, config.norm_eps)
            self.k_norm: nn.Module = RMSNorm(k_dim, config.norm_eps)
        if config.position == "relative":
            # Transformer-XL: projection of the sinusoidal relative embedding and the two learned biases.
            self.r_proj = nn.Linear(d, h * dh, bias=False)
            self.r_w_bias = nn.Parameter(torch.zeros(h, dh))
            self.r_r_bias = nn.Parameter(torch.zeros(h, dh))
        self.hidden_size = d
        # Computed by prepare() after the weights are loaded.
        self._qkv: tuple[torch.Tensor | PackedWeight, torch.Tensor | None] | None = None
        self._o: tuple[torch.Tensor | PackedWeight, torch.Tensor | None] | None = None
        self._rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [P, Dh]
        self._r_k: torch.Tensor | None = None  # [R, H, Dh]
        self._r_kt: torch.Tensor | None = None  # [H, Dh, R] (the C++ kernel's layout)
        self._r_offset = 0

    @torch.no_grad()
    def prepare(self) -> None:
        """One fused q/k/v projection, and the position tables for every position the context allows."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        weight = _fuse([p.weight for p in projections])
        bias = (
            hugepages.place(torch.cat([p.bias.detach() for p in projections])) if self.q_proj.bias is not None else None
        )
        # The three projections become views of the fused tensors: one copy of the weights in memory.
        for parts, fused in ((projections, weight), (projections, bias)):
            if fused is None:
                continue
            start = 0
            for p in parts:
                name = "weight" if fused is weight else "bias"
                size = getattr(p, name).shape[0]
                view = (
                    fused.rows(start, start + size) if isinstance(fused, PackedWeight) else fused[start : start + size]
                )
                setattr(p, name, view if isinstance(view, PackedWeight) else nn.Parameter(view, requires_grad=False))
                start += size
        self._qkv = (weight, bias)
        self._o = (self.o_proj.weight, self.o_proj.bias)
        device, max_len = weight.device, self.config.max_position_embeddings
        if self.position == "rotary":
            config = self.config
            self._rotary = rotary_tables(
                max_len, self.head_dim, config.rope_theta, config.rope_scaling, config.rotary_dim, device
            )
        elif self.position == "relative":
            low = 0 if self.is_causal else -(max_len - 1)
            distances = torch.arange(low, max_len, device=device)  # [R]
            r = sinusoid_relative(distances, self.hidden_size).to(self.r_proj.weight.dtype)  # [R, D]
            self._r_k = self.r_proj(r).view(-1, self.num_heads, self.head_dim)  # [R, H, Dh]
            self._r_kt = self._r_k.permute(1, 2, 0).contiguous()
            self._r_offset = -low

    def forward(self, x: torch.Tensor, batch: ForwardBatch, layer: int) -> torch.Tensor:
        """x [T, D] -> [T, D]; this step's keys and values go into the layer's cache when there is one."""
        return self._attend(x, batch, layer, keep_inputs=False)[0]

    def forward_with_inputs(
        self, x: torch.Tensor, batch: ForwardBatch, layer: int
    ) -> tuple[torch.Tensor, AttentionInputs]:
        """forward, and what the attention computed from: for a router that reads the layer's attention."""
        out, inputs = self._attend(x, batch, layer, keep_inputs=True)
        assert inputs is not None
        return out, inputs

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> q [T, H, Dh], k, v [T, G, Dh]: the fused projection, q/k norms and clipping (before
        positions are applied)."""
        if self._qkv is None:
            self.prepare()
        t = x.shape[0]
        h, g, dh = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = ops.linear(x, *self._qkv)  # type: ignore[misc]  # [T, (H + 2G) Dh]
        q, k, v = qkv.split([h * dh, g * dh, g * dh], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.qkv_clip is not None:
            q, k, v = (y.clamp(-self.qkv_clip, self.qkv_clip) for y in (q, k, v))
        q, k, v = q.reshape(t, h, dh), k.reshape(t, g, dh), v.reshape(t, g, dh)
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _attend(
        self, x: torch.Tensor, batch: ForwardBatch, layer: int, keep_inputs: bool
    ) -> tuple[torch.Tensor, AttentionInputs | None]:
        t, h, dh = x.shape[0], self.num_heads, self.head_dim
        q, k, v = self.project(x)
        attention = batch.attention_of(layer)
        rotary = None
        if self._rotary is not None:
            positions = attention.positions
            rotary = (self._rotary[0][positions], self._rotary[1][positions])  # cos, sin [T, Dh]
        cache = None if batch.kv_caches is None else batch.kv_caches[layer]
        q, k = ops.rotary_write(q, k, v, rotary, cache, attention)
        if self.temperature is not None:  # in fp32, as transformers, then back to q's dtype
            q = (q.float() * _temperature(self.temperature, attention.positions)[:, None, None]).to(q.dtype)
        relative = None
        if self._r_k is not None:
            relative = RelativeTerm(q + self.r_r_bias.to(q.dtype), self._r_k, self._r_kt, self._r_offset)  # type: ignore[arg-type]
            q = q + self.r_w_bias.to(q.dtype)
        sinks = self.sinks.float() if hasattr(self, "sinks") else None
        out = ops.attention(
            q.contiguous(),
            k,
            v,
            attention,
            cache,
            self.is_causal,
            self.scale,
            relative,
            window=self.window,
            chunk=self.chunk,
            sinks=sinks,
        )
        inputs = None
        if keep_inputs:  # the engine's paged steps only: no kind that reads attention exports to a graph
            assert not isinstance(cache, GraphCache)
            inputs = AttentionInputs(q, k, v, relative, self.scale, cache, self.o_proj.weight)
        return ops.linear(out.reshape(t, h * dh), *self._o), inputs  # type: ignore[misc]


def _temperature(t: AttentionTemperature, positions: torch.Tensor) -> torch.Tensor:
    """[T] the query scale at each position (AttentionTemperature), in transformers' operations."""
    return log1p(torch.floor((positions.float() + 1.0) / t.floor_scale)) * t.scale + 1.0


def _fuse(tensors: list[torch.Tensor | PackedWeight]) -> torch.Tensor | PackedWeight:
    if all(isinstance(t, PackedWeight) for t in tensors):  # packed weights (moe_serve.weights), fused as such
        fused = PackedWeight.cat_rows(tensors)  # type: ignore[arg-type]
        scales = hugepages.place(fused.scales) if fused.scales is not None else None
        return dataclasses.replace(fused, data=hugepages.place(fused.data), scales=scales)
    return hugepages.place(torch.cat([t.detach() for t in tensors]))  # type: ignore[union-attr]
