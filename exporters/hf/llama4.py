"""Llama 4 (`llama4`, text; `Llama4ForConditionalGeneration` exports its text model): `moe_layers` (or every
interleave_moe_layer_step-th layer) MoE, the others dense FFNs; experts `gate_up_proj` [N, D, 2I] (gate columns,
then up) and `down_proj` [N, I, D]; router `topk_sigmoid` whose weight scales each expert's input; local-chunk
layers with rotary and the L2 q/k norm, global layers without either (`no_rope_layers`), with temperature
tuning; rotary on interleaved pairs (q/k rows permuted: reorder.pairs_to_halves)."""

from __future__ import annotations

from typing import Any

import torch

from moe_serve.exporters.base import ExportError, SafetensorsCheckpoint
from moe_serve.exporters.hf.family import HFFamily, register
from moe_serve.exporters.hf.reorder import pairs_to_halves
from moe_serve.layers.routers import RouterConfig, router_config
from moe_serve.model_config import AttentionTemperature, LayerAttention, ModelConfig, RopeScaling, RopeType


@register
class Llama4(HFFamily):
    name = "Llama 4"
    architectures = ("Llama4ForCausalLM",)
    text_models = {"Llama4ForConditionalGeneration": "language_model."}
    num_experts_keys = ("num_local_experts",)
    expert_size_key = "intermediate_size"
    dense_size_key = "intermediate_size_mlp"
    shared_expert_size_key = "intermediate_size"
    weights_scale_input = True
    qk_norm = "per_head"
    qk_norm_key = "use_qk_norm"
    rope_types = ("linear", "yarn", "llama3")
    moe_prefix = "feed_forward"
    router_name = "router"
    shared_expert_prefix = "feed_forward.shared_expert"
    dense_prefix = "feed_forward"
    defaults = {  # Llama4TextConfig's
        "attention_chunk_size": 8192,
        "use_qk_norm": True,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
        "rms_norm_eps": 1e-5,
        "no_rope_layer_interval": 4,
        "interleave_moe_layer_step": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    }

    def rope_scaling(
        self, rope_type: RopeType, settings: dict[str, Any], original: int | None, hf: dict[str, Any]
    ) -> RopeScaling:
        if rope_type != "llama3":
            return super().rope_scaling(rope_type, settings, original, hf)
        return RopeScaling(
            type="llama3",
            factor=settings["factor"],
            original_max_position_embeddings=original,
            low_freq_factor=settings["low_freq_factor"],
            high_freq_factor=settings["high_freq_factor"],
        )

    def moe_layers(self, hf: dict[str, Any]) -> tuple[int, ...]:
        """transformers' Llama4TextConfig rule."""
        step = hf.get("interleave_moe_layer_step", 1) or 1
        return tuple(hf.get("moe_layers") or range(step - 1, hf["num_hidden_layers"], step))

    def router(self, hf: dict[str, Any]) -> RouterConfig:
        return router_config("topk_sigmoid")

    def layer_attention(self, hf: dict[str, Any], positions: int) -> dict[str, Any]:
        """Llama4TextConfig's rules: no_rope_layers (1: the layer uses rotary), when empty every
        no_rope_layer_interval-th layer without; layer_types, when absent, chunked on the rotary layers if a
        chunk size is set; and the temperature tuning of the layers without rotary."""
        if hf.get("attention_bias"):  # no released Llama 4 has them; their rows would need the rotary reorder too
            raise ExportError("config.json: attention_bias true is not supported for llama4")
        n, chunk = hf["num_hidden_layers"], hf.get("attention_chunk_size")
        interval = hf["no_rope_layer_interval"]
        rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
        types = hf.get("layer_types") or [
            "chunked_attention" if r and chunk is not None else "full_attention" for r in rope
        ]
        if len(rope) != n or len(types) != n or set(types) - {"chunked_attention", "full_attention"}:
            raise ExportError(
                f"config.json: no_rope_layers and layer_types need one entry per layer ({n}), layer_types "
                f"chunked_attention or full_attention; got {rope!r}, {types!r}"
            )
        spans = tuple(
            LayerAttention(
                chunk=chunk if t == "chunked_attention" else None, rotary=bool(r), qk_norm=bool(r)
            )  # transformers builds the L2 q/k norm on the rotary layers only
            for r, t in zip(rope, types, strict=True)
        )
        temperature = None
        if hf.get("attn_temperature_tuning") and not all(rope):
            temperature = AttentionTemperature(float(hf["floor_scale"]), float(hf["attn_scale"]))
        return {"layer_attention": spans, "attention_temperature": temperature}

    def qk_rows(self, rows: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        assert config.head_dim is not None
        return pairs_to_halves(rows, config.head_dim)

    def qk_norm_weights(
        self, checkpoint: SafetensorsCheckpoint, config: ModelConfig, src: str, dst: str
    ) -> dict[str, torch.Tensor]:
        """Its L2 norm after rotary: RMSNorm with unit weights (it has none), which commutes with a rotation."""
        assert config.head_dim is not None
        return {
            dst + "attn.q_norm.weight": torch.ones(config.head_dim),
            dst + "attn.k_norm.weight": torch.ones(config.head_dim),
        }

    def experts(
        self, checkpoint: SafetensorsCheckpoint, moe: str, dst: str, n: int, d: int, i: int
    ) -> dict[str, torch.Tensor]:
        """[N, in, out] banks, gate columns then up -> [N, out, in]."""
        gate_up = checkpoint.get(moe + "experts.gate_up_proj", (n, d, 2 * i)).transpose(1, 2)
        return {
            dst + "gate_proj.weight": gate_up[:, :i].contiguous(),
            dst + "up_proj.weight": gate_up[:, i:].contiguous(),
            dst + "down_proj.weight": checkpoint.get(moe + "experts.down_proj", (n, i, d)).transpose(1, 2).contiguous(),
        }
