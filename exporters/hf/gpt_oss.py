"""gpt-oss (`gpt_oss`): experts `gate_up_proj` [N, D, 2I] (gate and up interleaved along the last axis) and
`down_proj` [N, I, D], each with a bias, or the same as MXFP4 `_blocks` and `_scales` (dequantized:
moe_serve.exporters.mxfp4); the clamped SwiGLU (swiglu_alpha, swiglu_limit); a router with a bias; per-head
attention sinks; and `layer_types` alternating sliding-window and full attention (ModelConfig.layer_attention)."""

from __future__ import annotations

from typing import Any

import torch

from moe_serve.exporters import mxfp4
from moe_serve.exporters.base import ExportError, SafetensorsCheckpoint
from moe_serve.exporters.hf.family import HFFamily, register
from moe_serve.layers.routers import RouterConfig, router_config
from moe_serve.model_config import Activation, FFNConfig, LayerAttention


@register
class GptOss(HFFamily):
    name = "gpt-oss"
    architectures = ("GptOssForCausalLM",)
    num_experts_keys = ("num_local_experts",)
    expert_size_key = "intermediate_size"
    default_norm_topk_prob = True  # softmax over the top-k logits
    attention_out_bias = True
    moe_prefix = "mlp"
    router_name = "router"
    defaults = {  # GptOssConfig's
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "swiglu_alpha": 1.702,
        "sliding_window": 128,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
            "rope_theta": 150000.0,
        },
    }

    def router(self, hf: dict[str, Any]) -> RouterConfig:
        normalize = bool(hf.get("norm_topk_prob", self.default_norm_topk_prob))
        return router_config("topk_softmax", normalize=normalize, use_bias=True)

    def expert_ffn(self, hf: dict[str, Any], activation: Activation) -> FFNConfig:
        return FFNConfig(
            "glu",
            hf[self.expert_size_key],
            "swigluoai",
            use_bias=True,
            swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),  # transformers' default where older configs omit it
            swiglu_limit=float(hf["swiglu_limit"]),
        )

    def layer_attention(self, hf: dict[str, Any], positions: int) -> dict[str, Any]:
        """Each layer's `layer_types` entry (sliding_attention: a window of `sliding_window` keys;
        full_attention), and the attention sinks."""
        # GptOssConfig's default: sliding on the even layers (0, 2, ...), full on the odd ones
        types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(hf["num_hidden_layers"])
        ]
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown or len(types) != hf["num_hidden_layers"]:
            raise ExportError(
                f"config.json: layer_types must give sliding_attention or full_attention for each of the "
                f"{hf['num_hidden_layers']} layers; got {types!r}"
            )
        window = hf.get("sliding_window") if "sliding_attention" in types else None
        if "sliding_attention" in types and not isinstance(window, int):
            raise ExportError(f"config.json: sliding_attention layers need an integer sliding_window; got {window!r}")
        spans = tuple(LayerAttention(window=window if t == "sliding_attention" else None) for t in types)
        return {"layer_attention": spans, "attention_sinks": True}

    def experts(
        self, checkpoint: SafetensorsCheckpoint, moe: str, dst: str, n: int, d: int, i: int
    ) -> dict[str, torch.Tensor]:
        """The float layout transformers saves ([N, in, out], gate and up interleaved), or the released MXFP4
        blocks and scales ([N, out, in / 32, 16], dequantized to float32) -> [N, out, in] banks."""
        src = moe + "experts."
        if src + "gate_up_proj_blocks" in checkpoint:
            gate_up = mxfp4.dequantize(
                checkpoint.get(src + "gate_up_proj_blocks", (n, 2 * i, d // mxfp4.BLOCK, mxfp4.BLOCK // 2)),
                checkpoint.get(src + "gate_up_proj_scales", (n, 2 * i, d // mxfp4.BLOCK)),
                torch.float32,
                src + "gate_up_proj",
            )  # [N, 2I, D]
            down = mxfp4.dequantize(
                checkpoint.get(src + "down_proj_blocks", (n, d, i // mxfp4.BLOCK, mxfp4.BLOCK // 2)),
                checkpoint.get(src + "down_proj_scales", (n, d, i // mxfp4.BLOCK)),
                torch.float32,
                src + "down_proj",
            )  # [N, D, I]
        else:
            gate_up = checkpoint.get(src + "gate_up_proj", (n, d, 2 * i)).transpose(1, 2)
            down = checkpoint.get(src + "down_proj", (n, i, d)).transpose(1, 2)
        bias = checkpoint.get(src + "gate_up_proj_bias", (n, 2 * i))
        return {
            dst + "gate_proj.weight": gate_up[:, 0::2].contiguous(),
            dst + "up_proj.weight": gate_up[:, 1::2].contiguous(),
            dst + "down_proj.weight": down.contiguous(),
            dst + "gate_proj.bias": bias[:, 0::2].contiguous(),
            dst + "up_proj.bias": bias[:, 1::2].contiguous(),
            dst + "down_proj.bias": checkpoint.get(src + "down_proj_bias", (n, d)),
        }
