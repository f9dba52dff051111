"""The decoder layers of a CPU decode step in one C++ call (the extension's DecodeStack; docs/architecture.md
§6): for a batch of decodes, a bandwidth-bound step of a small model otherwise spends a large share of its
time in the host glue between kernels, ~20 Python module calls per layer.

It applies to the plain MoE decoder most checkpoints are (Mixtral, Qwen3-MoE, OLMoE without qk norm): pre-norm
RMSNorm, rotary or learned positions, every layer an MoE layer whose router is a top-k of its logits under one
of the kernels' weightings, no shared expert, residuals unscaled, fp32 activations and cache on the C++ kernels
(the attention's scale is handed over; the embedding and logit scales apply outside the layers). Everything
else, and every step that is not decode-only, runs the Python layers. Both paths call the same kernels with the
same operands in the same order, so a token's result does not depend on which ran
(tests/unit/engine/test_decode_stack.py checks it bitwise).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from moe_serve.engine.kv_cache import KVCache
from moe_serve.kernels import cpu_extension
from moe_serve.kernels.vocabulary import (
    ACTIVATION_IDS,
    ACTIVATIONS,
    LINEAR_MAX_ROWS,
    AttentionBatch,
    kernel_format,
    kernel_parts,
)
from moe_serve.layers.attention import Attention
from moe_serve.layers.batch import ForwardBatch
from moe_serve.layers.norm import RMSNorm
from moe_serve.layers.routers import Router
from moe_serve.models.transformer import MoETransformer

logger = logging.getLogger(__name__)


def unsupported_reason(model: MoETransformer, cache: KVCache | None) -> str | None:
    """Why the decode stack cannot run this model's decode steps (None: it can)."""
    config = model.config
    if config.latent_attention is not None:  # its cache holds latents, not the keys and values the stack reads
        return "its layers run plain attention only (this model has multi-head latent attention)"
    if cache is None or cache.layers[0][0].device.type != "cpu" or cpu_extension() is None:
        return "it runs on the CPU kernels, with a KV cache"
    if model.embed_tokens.weight.dtype != torch.float32 or cache.layers[0][0].dtype != torch.float32:
        return "it runs float32 activations and cache"
    if cache.shape.block_size % 16:
        return "the CPU attention kernel reads blocks of a multiple of 16 tokens"
    if config.norm_position != "pre" or config.norm != "rmsnorm" or config.position == "relative":
        return "it runs pre-norm RMSNorm layers with rotary or learned positions"
    if config.attention_features:
        return f"its layers run plain attention only (this model has {', '.join(config.attention_features)})"
    if config.residual_scale != 1.0:  # the C++ layers add each branch to the residual as it is
        return f"it adds each layer's outputs to the residual unscaled (residual_scale is {config.residual_scale})"
    for layer in model.decoder_layers:
        attn = layer.attn
        if type(attn) is not Attention or not attn.is_causal or attn.qk_norm is not None or attn.qkv_clip is not None:
            return "it runs moe-serve's causal attention without q/k norms or clipping"
        if attn._qkv is None or attn._o is None or (config.position == "rotary" and attn._rotary is None):
            return "the model is not prepared (MoETransformer.prepare)"
        if not layer.is_moe:
            return "every layer must be an MoE layer"
        moe = layer.moe
        kind = type(moe.router_kind)
        if kind.route is not Router.route or kind.per_sequence or moe._stateful or kind.reads_attention:
            return f"router kind {kind.kind} is not a top-k of its logits under one of the kernels' weightings"
        if moe.config.shared_expert is not None or moe.config.hyper_expert is not None or moe.local_experts:
            return "it runs the routed experts only (no shared expert, adapters or expert parallelism)"
        if moe.config.weights_scale_input:
            return "it weights each expert's output (weights_scale_input weights its input)"
        if moe.config.expert.activation not in ACTIVATIONS:  # the clamped SwiGLU is a GLU of its own
            return f"it runs the plain activations (not {moe.config.expert.activation})"
        if moe._router is None or moe._bank is None:
            return "the model is not prepared (MoETransformer.prepare)"
        if moe.input_norm is not None or not isinstance(layer.attn_norm, RMSNorm):
            return "it runs RMSNorm before attention and experts only"
    return None


def decode_stack_for(model: MoETransformer, cache: KVCache | None, enabled: bool) -> DecodeStack | None:
    """The model's decode stack over this cache, or None (the reason logged) where it does not apply."""
    if not enabled:
        return None
    reason = unsupported_reason(model, cache)
    if reason is not None:
        logger.info("decode steps run layer by layer in Python: %s", reason)
        return None
    assert cache is not None
    # Several KV groups come only from windows or chunks (engine.kv_cache.kv_layout), refused above: the stack
    # reads the one block table a step has.
    assert len(cache.shape.layout.groups) == 1
    return DecodeStack(model, cache)


class DecodeStack:
    """Built once per runner: every layer's operands handed to the C++ DecodeStack."""

    def __init__(self, model: MoETransformer, cache: KVCache) -> None:
        ext = cpu_extension()
        assert ext is not None
        self.caches = cache.layers
        self._stack = ext.DecodeStack(LINEAR_MAX_ROWS)
        self._rotary: tuple[torch.Tensor, torch.Tensor] | None = None
        for index, layer in enumerate(model.decoder_layers):
            attn, moe = layer.attn, layer.moe
            assert isinstance(attn, Attention)  # unsupported_reason refuses every other attention
            assert attn._qkv is not None and attn._o is not None and moe._router is not None and moe._bank is not None
            self._rotary = attn._rotary
            bank = moe._bank
            k_cache, v_cache = self.caches[index]
            self._stack.add_layer(
                layer.attn_norm.weight,
                layer.attn_norm.eps,
                layer.ffn_norm.weight,
                layer.ffn_norm.eps,
                *_operand(attn._qkv[0]),
                attn._qkv[1],
                *_operand(attn._o[0]),
                attn._o[1],
                attn.num_heads,
                attn.num_kv_heads,
                attn.head_dim,
                attn.scale,
                moe._router[0],
                moe._router[1],
                int(moe.router_kind.weighting),
                kernel_format(bank.w1),
                *kernel_parts(bank.w1),
                bank.b1,
                *(kernel_parts(bank.w3) if bank.w3 is not None else (None, None)),
                bank.b3,
                *_operand(bank.w2),
                bank.b2,
                ACTIVATION_IDS[bank.activation],
                k_cache,
                v_cache,
            )
        config = model.config
        head_weight, head_bias = model.lm_head_weights()
        self._stack.set_head(
            model.norm.weight if config.final_norm else None,
            model.norm.eps if config.final_norm else 0.0,
            *_operand(head_weight),
            head_bias,
            config.logits_divisor,
        )
        self._loads = [layer.moe for layer in model.decoder_layers]
        self.track_expert_load()

    def track_expert_load(self) -> None:
        """Hand the layers' expert-load counters (MoEBlock.expert_load) to the stack, which counts into them."""
        self._stack.set_expert_load([moe.expert_load for moe in self._loads])

    def accepts(self, batch: ForwardBatch) -> bool:
        """A decode-only step over this cache at fixed k (top-p steps, graph exports: the Python layers)."""
        attention = batch.attention
        return (
            isinstance(attention, AttentionBatch)
            and batch.kv_caches is self.caches
            and attention.block_tables is not None
            and attention.slot_mapping is not None
            and batch.adaptive_k is None
            and batch.expert_counts is None
            and max(attention.seq_lens) == 1  # one token per sequence
        )

    def __call__(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The layers: h [T, D] after the embeddings -> after the last layer (before the final norm)."""
        return self._stack.run(h, *self._step_inputs(batch))

    def logits(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The layers, the final norm and the LM head (divided by the logits' divisor): h [T, D] after the
        embeddings -> every row's logits [T, V] fp32, what MoETransformer.lm_logits gives for them."""
        return self._stack.run_logits(h, *self._step_inputs(batch))

    def _step_inputs(self, batch: ForwardBatch) -> tuple:
        attention = batch.attention
        assert isinstance(attention, AttentionBatch)
        cos, sin = self._rotary if self._rotary is not None else (None, None)
        return (
            cos,
            sin,
            attention.positions,
            attention.seq_ids,
            attention.num_keys,
            attention.block_tables,
            attention.slot_mapping,
            batch.token_k,
            batch.max_k,
        )

    def set_timing(self, enabled: bool) -> None:
        """Time each part of the stacked steps from now on (read with `timings`), or stop."""
        self._stack.set_timing(enabled)

    def timings(self) -> dict[str, float]:
        """Seconds per part (norms, projections, attention, router, experts, LM head ...) since the last read."""
        return dict(self._stack.timings())


def _operand(weight: Any) -> tuple[str | None, torch.Tensor, torch.Tensor | None]:
    """(format, data, scales) as the C++ kernels take a weight."""
    return (kernel_format(weight), *kernel_parts(weight))
