"""The artifact's network as a graph that `torch.onnx.export` can trace: padded [B, T] batches, plain torch
ops only, k per row as a tensor.

Legend: B rows, T new tokens per row, P past tokens, S = P + T keys, H query heads, G key/value heads, Dh
head dim, D hidden, N experts, K = the model's largest k (router slots), M = B * T token rows, C classes,
V vocabulary.

Why a second spelling of the forward pass: the engine runs token-packed batches with host-side lengths,
per-sequence Python loops and C++ kernels, none of which a trace can follow. The weights are the loaded
model's own parameters, the pure helpers are shared (apply_ffn, apply_rotary, ops.ACTIVATIONS), and the
math follows the torch reference paths of moe_serve.kernels.ops (topk_route_torch, moe_experts_torch,
attention_torch); tests/exporters/test_onnx.py proves the graph against the engine.

Experts per row: the router takes the top K = max k slots of every token (ONNX TopK; ties go to the lower
index), slots at or beyond the row's own k get weight 0, and each expert then runs only on the token slots
routed to it (NonZero, Gather, MatMul, ScatterND): a slot beyond a row's k is never computed, so the
expert cost follows the sum of the rows' k. soft_merge merges parameters instead: its K slots are all
merged (weight 0 beyond k), a cost per row independent of the tokens.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from moe_serve.layers.ffn import apply_ffn
from moe_serve.layers.positions import apply_rotary, rotary_cos_sin
from moe_serve.layers.routers.hyper_expert import pattern_index
from moe_serve.models import MoETransformer

# topk_softmax's normalize flag (or the kind) -> how the chosen slots are weighted (ops.topk_route_torch).
ROUTE_MODES = {"topk_uniform": "uniform", "soft_merge": "softmax_chosen"}


def _norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm or LayerNorm (moe_serve.layers.norm) in plain ops (its forward may call C++)."""
    if hasattr(module, "bias"):
        # int(): the normalised shape is a constant of the graph, not a traced size.
        return F.layer_norm(x, [int(module.weight.shape[0])], module.weight, module.bias, module.eps)
    return module.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps))


def _linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight, module.bias)


def route(logits: torch.Tensor, top_k: torch.Tensor, max_k: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, N] fp32, top_k [R] -> ids [R, K] (-1 beyond a row's k), weights [R, K] (0 beyond it).

    ops.topk_route_torch with TopK instead of a full sort, and rows with k = 0 (padding) weighted 0
    rather than NaN."""
    topk_logits, topk_ids = torch.topk(logits, max_k, dim=-1)  # ONNX TopK: ties to the lower index
    used = torch.arange(max_k, device=logits.device)[None, :] < top_k[:, None]  # [R, K]
    if mode == "uniform":
        weights = used.float() / top_k.clamp(min=1)[:, None].float()
    elif mode == "softmax_all":
        weights = torch.softmax(logits, dim=-1).gather(1, topk_ids) * used
    else:
        weights = torch.softmax(topk_logits.masked_fill(~used, float("-inf")), dim=-1)
        weights = torch.where(used, weights, torch.zeros_like(weights))  # a k = 0 row is all -inf: NaN
    return topk_ids.masked_fill(~used, -1), weights


class GraphModel(nn.Module):
    """What both task graphs share: embeddings, attention over a padded batch with an optional past, the
    FFN or MoE of each layer, the final norm. `model` is a loaded fp32 artifact model (after prepare())."""

    def __init__(self, model: MoETransformer) -> None:
        super().__init__()
        self.model = model
        self.config = config = model.config
        self.max_k = config.moe.max_k if config.moe is not None else 0
        if config.position == "relative":
            # The engine's table of projected sinusoids, one row per distance (Attention.prepare): a
            # constant of the graph, so the positional term costs a slice and a gather, not a projection.
            for i, layer in enumerate(model.layers):
                self.register_buffer(f"relative_{i}", layer.attn._r_k, persistent=False)
            self.relative_offset = model.layers[0].attn._r_offset

    # ---- attention ------------------------------------------------------------------------------

    def attention(
        self,
        i: int,
        x: torch.Tensor,  # [B, T, D]
        allowed: torch.Tensor,  # [B, T, S] bool: which keys each query sees
        query_pos: torch.Tensor,  # [B, T] int64
        key_pos: torch.Tensor,  # [B, S] int64
        past: tuple[torch.Tensor, torch.Tensor] | None,  # [B, G, P, Dh] x2
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """-> output [B, T, D] and the keys and values of every position so far ([B, G, S, Dh] x2)."""
        attn = self.model.layers[i].attn
        h, g, dh = attn.num_heads, attn.num_kv_heads, attn.head_dim
        b, t = x.shape[0], x.shape[1]
        q, k, v = _linear(attn.q_proj, x), _linear(attn.k_proj, x), _linear(attn.v_proj, x)
        if attn.qk_norm == "full":
            q, k = _norm(attn.q_norm, q), _norm(attn.k_norm, k)
        if attn.qkv_clip is not None:
            q, k, v = (y.clamp(-attn.qkv_clip, attn.qkv_clip) for y in (q, k, v))
        q, k, v = q.reshape(b, t, h, dh), k.reshape(b, t, g, dh), v.reshape(b, t, g, dh)
        if attn.qk_norm == "per_head":
            q, k = _norm(attn.q_norm, q), _norm(attn.k_norm, k)
        if attn.position == "rotary":
            cos, sin = rotary_cos_sin(query_pos.reshape(-1), dh, self.config.rope_theta, self.config.rope_scaling)
            q = apply_rotary(q.reshape(-1, h, dh), cos, sin).reshape(b, t, h, dh)
            k = apply_rotary(k.reshape(-1, g, dh), cos, sin).reshape(b, t, g, dh)
        keys, values = k.transpose(1, 2), v.transpose(1, 2)  # [B, G, T, Dh]
        if past is not None:
            keys, values = torch.cat([past[0], keys], dim=2), torch.cat([past[1], values], dim=2)
        present = (keys, values)
        # Grouped-query attention: query head j reads key/value head j // (H / G), as SDPA's enable_gqa.
        keys = keys[:, :, None].expand(-1, -1, h // g, -1, -1).reshape(b, h, -1, dh)  # [B, H, S, Dh]
        values = values[:, :, None].expand(-1, -1, h // g, -1, -1).reshape(b, h, -1, dh)
        queries = q.transpose(1, 2)  # [B, H, T, Dh]
        if attn.position == "relative":
            relative = self._relative_scores(i, q + attn.r_r_bias, query_pos, key_pos)
            queries = (q + attn.r_w_bias).transpose(1, 2)
        scores = torch.matmul(queries, keys.transpose(2, 3))  # [B, H, T, S]
        if attn.position == "relative":
            scores = scores + relative
        scores = (scores * attn.scale).masked_fill(~allowed[:, None], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [B, H, T, Dh]
        return _linear(attn.o_proj, out.transpose(1, 2).reshape(b, t, h * dh)), present

    def _relative_scores(
        self, i: int, q_rel: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor
    ) -> torch.Tensor:
        """Transformer-XL's positional term (q + r_r_bias) . r_k[i - j]: [B, H, T, S] (ops.RelativeTerm).

        Every query against every distance in the table's first rows, then one gather by distance (the
        rel-shift as an index), instead of a projection per (query, key) pair."""
        table = getattr(self, f"relative_{i}")  # [R, H, Dh]
        s = key_pos.shape[1]
        low = self.relative_offset - (s - 1) if not self.config.is_causal else 0
        rows = table[low : self.relative_offset + s]  # every distance a key can be at: [R', H, Dh]
        by_distance = torch.matmul(q_rel.transpose(1, 2), rows.permute(1, 2, 0))  # [B, H, T, R']
        distance = query_pos[:, :, None] - key_pos[:, None, :] + (self.relative_offset - low)  # [B, T, S]
        # A key after the query (masked anyway) has a negative distance; no distance exceeds the slice.
        index = distance.clamp(min=0)[:, None].expand(-1, q_rel.shape[2], -1, -1)  # [B, H, T, S]
        return torch.gather(by_distance, 3, index)

    # ---- feed-forward -----------------------------------------------------------------------------

    def ffn(
        self, i: int, x: torch.Tensor, token_k: torch.Tensor, row_k: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, T, D] -> ([B, T, D], tokens routed to each expert [N] int64: None for a dense layer);
        token_k [B * T] (0 for padding), row_k [B], mask [B, T] float."""
        layer = self.model.layers[i]
        if not layer.is_moe:
            return apply_ffn(layer.ffn.config, lambda name, h: _linear(getattr(layer.ffn, name), h), x), None
        block = layer.moe
        experts = torch.arange(block.config.num_experts, device=x.device)
        if block.routing.per_sequence:
            out, ids = self._merged_experts(block, x, row_k, mask)
            # One decision per row stands for each of its real tokens (MoEBlock._count's tokens_per_row).
            tokens = mask.sum(1).long()[:, None, None]  # [B, 1, 1]
            counts = ((ids[..., None] == experts) * tokens).sum((0, 1))
        else:
            flat = x.reshape(-1, x.shape[-1])  # [M, D]
            mode = ROUTE_MODES.get(block.config.router.kind) or (
                "softmax_chosen" if block.config.router.normalize else "softmax_all"
            )
            ids, weights = route(_linear(block.router, flat.float()), token_k, self.max_k, mode)
            out = self._experts(block.experts, flat, ids, weights)
            if block.config.hyper_expert is not None:  # HyperMoE: the selected set's adapter, weight 1
                pattern = pattern_index(ids, block.config.num_experts)[:, None]  # padding: -1, no adapter
                out = out + self._experts(block.hyper, flat, pattern, torch.ones_like(pattern, dtype=flat.dtype))
            out = out.reshape(x.shape)
            counts = (ids[..., None] == experts).sum((0, 1))  # -1 (unused slots, padding) matches none
        if block.config.shared_expert is not None:
            expert = block.shared_expert
            shared = apply_ffn(expert.config, lambda name, h: _linear(getattr(expert, name), h), x)
            if block.config.shared_expert_gate:
                shared = torch.sigmoid(F.linear(x, block.shared_expert_gate.weight)) * shared
            out = out + shared
        return out, counts.to(torch.int64)

    def _experts(self, bank: nn.Module, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [M, D], ids [M, K] (-1: unused), weights [M, K] -> [M, D] (ops.moe_experts_torch's math): each
        expert on the token slots routed to it only, the slots combined in slot order."""
        m, k = ids.shape
        flat_ids = ids.reshape(-1)  # [M * K] slot -> expert
        per_slot = x.new_zeros(m * k, x.shape[-1])  # [M * K, D]
        for e in range(bank.num_experts):
            slots = torch.nonzero(flat_ids == e).reshape(-1)  # [n_e] the slots routed to expert e
            rows = torch.div(slots, k, rounding_mode="floor")

            def linear(name: str, h: torch.Tensor, e: int = e) -> torch.Tensor:
                part = getattr(bank, name)
                return F.linear(h, part.weight[e], None if part.bias is None else part.bias[e])

            per_slot = per_slot.index_put((slots,), apply_ffn(bank.config, linear, x[rows]))
        return (per_slot.reshape(m, k, -1) * weights[..., None]).sum(1)

    def _merged_experts(
        self, block: nn.Module, x: torch.Tensor, row_k: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """soft_merge (SMEAR): one decision per row from the masked mean of its tokens, and one expert whose
        parameters are the weighted average of the chosen experts' (ExpertBank.forward_merged). -> the
        output and the chosen ids [B, K] (-1 beyond a row's k)."""
        pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # [B, D]
        if block.config.router.input_norm is not None:
            pooled = _norm(block.router_norm, pooled)
        chosen, weights = route(_linear(block.router, pooled), row_k, self.max_k, "softmax_chosen")
        ids = chosen.clamp(min=0)  # unused slots carry weight 0
        bank = block.experts

        def merge(param: torch.Tensor) -> torch.Tensor:  # [E, ...] -> [B, ...]
            w = weights
            for _ in range(param.dim() - 1):
                w = w[..., None]
            return (w * param[ids]).sum(1)  # [B, K, ...] summed in slot order

        def linear(name: str, h: torch.Tensor) -> torch.Tensor:  # h [B, T, in]
            part = getattr(bank, name)
            out = torch.matmul(h, merge(part.weight).transpose(1, 2))
            return out if part.bias is None else out + merge(part.bias)[:, None]

        return apply_ffn(bank.config, linear, x), chosen

    # ---- the stack --------------------------------------------------------------------------------

    def layers(
        self,
        input_ids: torch.Tensor,  # [B, T]
        key_mask: torch.Tensor,  # [B, S] int64, 1 for real tokens (past included)
        experts_per_token: torch.Tensor,  # [B] int64
        pasts: list[tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
        """-> final hidden states [B, T, D], each layer's keys and values so far, and the tokens routed to
        each expert per MoE layer in this run ([L_moe, N] int64; None without MoE layers)."""
        config = self.config
        t, s = input_ids.shape[1], key_mask.shape[1]
        key_pos = (torch.cumsum(key_mask, dim=1) - 1).clamp(min=0)  # [B, S] a token's place in its sequence
        query_mask = key_mask[:, s - t :]  # [B, T]
        query_pos = key_pos[:, s - t :]
        query_index = torch.arange(t, device=input_ids.device) + (s - t)  # [T] each query's cache index
        key_index = torch.arange(s, device=input_ids.device)  # [S]
        visible = key_mask[:, None, :].bool()  # [B, 1, S]
        if config.is_causal:
            visible = visible & (key_index[None, :] <= query_index[:, None])[None]
        # Every query sees itself, so a padding row's softmax has a finite term (no NaN that a later
        # layer's values could carry into real rows).
        allowed = visible | (key_index[None, :] == query_index[:, None])[None]  # [B, T, S]
        mask = query_mask.float()
        token_k = (experts_per_token[:, None] * query_mask).reshape(-1)  # padding: k = 0, no experts

        h = F.embedding(input_ids, self.model.embed_tokens.weight)
        if config.embedding_scale != 1.0:
            h = h * config.embedding_scale
        if config.position == "learned":
            h = h + F.embedding(query_pos, self.model.embed_positions.weight)
        presents, counts = [], []
        for i, layer in enumerate(self.model.layers):
            past = pasts[i] if pasts is not None else None
            if layer.is_pre_norm:
                out, present = self.attention(i, _norm(layer.attn_norm, h), allowed, query_pos, key_pos, past)
                h = h + out
                out, routed = self.ffn(i, _norm(layer.ffn_norm, h), token_k, experts_per_token, mask)
                h = h + out
            else:
                out, present = self.attention(i, h, allowed, query_pos, key_pos, past)
                h = _norm(layer.attn_norm, h + out)
                out, routed = self.ffn(i, h, token_k, experts_per_token, mask)
                h = _norm(layer.ffn_norm, h + out)
            presents.append(present)
            if routed is not None:
                counts.append(routed)
        if config.final_norm:
            h = _norm(self.model.norm, h)
        return h, presents, torch.stack(counts) if counts else None


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
        hidden, presents, counts = self.layers(input_ids, attention_mask, experts_per_token, pasts)
        model = self.model
        if self.config.tie_word_embeddings:
            bias = model.lm_head_bias if self.config.lm_head_bias else None
            logits = F.linear(hidden, model.embed_tokens.weight, bias)
        else:
            logits = F.linear(hidden, model.lm_head.weight, model.lm_head.bias)
        outputs = (logits, *(t for present in presents for t in present))
        return outputs if counts is None else (*outputs, counts)


class ClassifierGraph(GraphModel):
    """(input_ids [B, T], attention_mask [B, T], experts_per_token [B]) -> (logits [B, C], probs [B, C], and
    with MoE layers expert_counts [L_moe, N])."""

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, experts_per_token: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        hidden, _, counts = self.layers(input_ids, attention_mask, experts_per_token, None)  # [B, T, D]
        classifier = self.config.classifier
        assert classifier is not None
        mask = attention_mask.float()
        if classifier.pooling == "mean":
            pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        else:
            positions = torch.arange(attention_mask.shape[1], device=hidden.device)[None, :]
            # float: onnxruntime's ArgMax takes no int64 (the first maximum wins in both).
            if classifier.pooling == "first":
                index = torch.argmax(mask, dim=1)  # the first real token
            else:
                index = torch.argmax(mask * positions, dim=1)  # the last real token
            pooled = torch.gather(hidden, 1, index[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]
        if classifier.pooler_dense:
            pooled = torch.tanh(_linear(self.model.pooler, pooled))
        logits = _linear(self.model.classifier, pooled)
        outputs = (logits, torch.softmax(logits, dim=-1))
        return outputs if counts is None else (*outputs, counts)


__all__ = ["CausalLMGraph", "ClassifierGraph", "route"]
