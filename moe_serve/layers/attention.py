"""Multi-head attention for every position kind, reading an explicit BatchLayout (no global context).

Legend: B sequences, L query tokens per sequence (right-padded), S key positions, H query heads,
G key/value heads, Dh head dim, D hidden size.

With a KV cache, keys live at their absolute positions in the sequence's cache slot, so prefill,
chunked prefill and decode all read the same way. Transformer-XL relative attention is served from the
same cache: its positional term only needs the distance between query and key positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from moe_serve.layers.norm import RMSNorm
from moe_serve.layers.positions import apply_rotary, rotary_cos_sin, sinusoid_relative
from moe_serve.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """Where each token of a padded batch sits.

    positions:       [B, L] absolute position of each query token in its sequence
    token_mask:      [B, L] True for real tokens, False for padding
    slot_ids:        [B] KV-cache rows of the sequences (None: no cache, keys are the batch's own tokens)
    context_lens:    [B] number of cached positions valid after this step (cache only)
    max_context_len: host int, max(context_lens) (cache only), so no device sync is needed to slice
    first_slot:      host int when slot_ids are consecutive (first_slot, first_slot + 1, ...): the cache
                     is then read as a view instead of gathered
    """

    positions: torch.Tensor
    token_mask: torch.Tensor
    slot_ids: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    max_context_len: int = 0
    first_slot: int | None = None


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, h, g, dh = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        assert h is not None and g is not None and dh is not None
        self.num_heads, self.num_kv_heads, self.head_dim = h, g, dh
        self.is_causal = config.is_causal
        self.position = config.position
        self.rope_theta = config.rope_theta
        self.rope_scaling = config.rope_scaling
        self.qkv_clip = config.qkv_clip
        self.scale = dh**-0.5
        self.q_proj = nn.Linear(d, h * dh, bias=config.attention_bias)
        self.k_proj = nn.Linear(d, g * dh, bias=config.attention_bias)
        self.v_proj = nn.Linear(d, g * dh, bias=config.attention_bias)
        self.o_proj = nn.Linear(h * dh, d, bias=config.attention_out_bias)
        self.qk_norm = config.qk_norm
        if config.qk_norm is not None:
            # per_head: one RMSNorm over each head's Dh (Qwen3-MoE); full: over all heads at once (OLMoE).
            q_dim, k_dim = (dh, dh) if config.qk_norm == "per_head" else (h * dh, g * dh)
            self.q_norm = RMSNorm(q_dim, config.norm_eps)
            self.k_norm = RMSNorm(k_dim, config.norm_eps)
        if config.position == "relative":
            # Transformer-XL: projection of the sinusoidal relative embedding and the two learned biases.
            self.r_proj = nn.Linear(d, h * dh, bias=False)
            self.r_w_bias = nn.Parameter(torch.zeros(h, dh))
            self.r_r_bias = nn.Parameter(torch.zeros(h, dh))
        self.hidden_size = d

    def forward(
        self,
        x: torch.Tensor,  # [B, L, D]
        layout: BatchLayout,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,  # each [slots, G, max_len, Dh]
    ) -> torch.Tensor:
        b, l, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B, L, H*Dh], [B, L, G*Dh] x2
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.qkv_clip is not None:
            q, k, v = (t.clamp(-self.qkv_clip, self.qkv_clip) for t in (q, k, v))
        q = q.view(b, l, self.num_heads, self.head_dim)  # [B, L, H, Dh]
        k = k.view(b, l, self.num_kv_heads, self.head_dim)  # [B, L, G, Dh]
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, L, Dh], [B, G, L, Dh]
        v = v.view(b, l, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, G, L, Dh]
        if self.position == "rotary":
            cos, sin = rotary_cos_sin(layout.positions, self.head_dim, self.rope_theta, self.rope_scaling)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        if kv_cache is None:
            key_positions = layout.positions  # [B, S=L]
            key_valid = layout.token_mask
        else:
            k, v = self._write_and_read_cache(k, v, layout, kv_cache)
            s = layout.max_context_len
            key_positions = torch.arange(s, device=x.device).expand(b, s)
            key_valid = key_positions < layout.context_lens[:, None]  # type: ignore[index]

        allowed = key_valid[:, None, :]  # [B, 1, S]
        if self.is_causal:
            allowed = allowed & (key_positions[:, None, :] <= layout.positions[:, :, None])  # [B, L, S]
        # Padding query rows attend everywhere: their output is discarded, and a fully masked row gives NaN.
        allowed = allowed | ~layout.token_mask[:, :, None]
        allowed = allowed[:, None]  # [B, 1, L, S]

        if self.position == "relative":
            bias = self._relative_bias(q, layout.positions, key_positions)  # [B, H, L, S]
            attn_bias = bias.masked_fill(~allowed, float("-inf"))
            q = q + self.r_w_bias[None, :, None, :].to(q.dtype)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_bias.to(q.dtype), scale=self.scale, enable_gqa=True
            )
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale, enable_gqa=True)
        out = out.transpose(1, 2).reshape(b, l, self.num_heads * self.head_dim)  # [B, L, H*Dh]
        return self.o_proj(out)

    def _write_and_read_cache(
        self,
        k: torch.Tensor,  # [B, G, L, Dh]
        v: torch.Tensor,
        layout: BatchLayout,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache, v_cache = kv_cache
        assert layout.slot_ids is not None
        mask = layout.token_mask
        slots = layout.slot_ids[:, None].expand_as(mask)[mask]  # [T]
        positions = layout.positions[mask]  # [T]
        k_cache[slots, :, positions] = k.transpose(1, 2)[mask]  # [T, G, Dh]
        v_cache[slots, :, positions] = v.transpose(1, 2)[mask]
        s = layout.max_context_len
        if layout.first_slot is not None:  # consecutive slots: a view, no copy of the cache
            rows = slice(layout.first_slot, layout.first_slot + len(layout.slot_ids))
            return k_cache[rows, :, :s], v_cache[rows, :, :s]  # [B, G, S, Dh]
        return k_cache[layout.slot_ids, :, :s], v_cache[layout.slot_ids, :, :s]

    def _relative_bias(
        self,
        q: torch.Tensor,  # [B, H, L, Dh]
        query_positions: torch.Tensor,  # [B, L]
        key_positions: torch.Tensor,  # [B, S]
    ) -> torch.Tensor:
        """Transformer-XL positional term (q + v_bias) . W_r R[i - j], scaled like the content term."""
        s = key_positions.shape[1]
        max_distance = max(s, int(query_positions.shape[1])) - 1
        low = 0 if self.is_causal else -max_distance
        distances = torch.arange(low, max_distance + 1, device=q.device)  # [R]
        r = sinusoid_relative(distances, self.hidden_size).to(q.dtype)  # [R, D]
        r_k = self.r_proj(r).view(-1, self.num_heads, self.head_dim)  # [R, H, Dh]
        q_r = q + self.r_r_bias[None, :, None, :].to(q.dtype)
        scores = torch.einsum("bhld,rhd->bhlr", q_r, r_k)  # [B, H, L, R]
        index = query_positions[:, :, None] - key_positions[:, None, :] - low  # [B, L, S]
        index = index.clamp(0, len(distances) - 1)[:, None].expand(-1, self.num_heads, -1, -1)
        return torch.gather(scores, -1, index).float() * self.scale  # [B, H, L, S]
