"""Hugging Face MoE directories (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Phi-3.5-MoE, Granite-MoE with and
without a shared expert, gpt-oss, Llama 4) -> moe-serve artifacts.

Weights are mapped by name (the tables below are the whole mapping) and experts are stacked into
[N, out, in] banks. Each model keeps its routing convention: Mixtral and Granite renormalise the top-k
weights (`topk_softmax`, normalize=true); Qwen and OLMoE follow `norm_topk_prob` (false: raw softmax mass);
Phi-3.5-MoE routes with `sparsemixer` (moe_serve/layers/routers/sparsemixer.py says what k means there).
DeepSeek-V2/V3 add multi-head latent attention and group-limited routing (exporters/hf_deepseek.py).
The trained `num_experts_per_tok` becomes the default k; requests may choose any k in 1..N (DeepSeek: up to
what its groups kept hold).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm.auto import tqdm

from moe_serve.errors import ConfigError
from moe_serve.exporters import hf_deepseek, mxfp4
from moe_serve.exporters.base import (
    DEFAULT_OPTIONS,
    ExportError,
    ExportOptions,
    SafetensorsCheckpoint,
    read_json,
    write,
)
from moe_serve.model_config import NormKind
from moe_serve.layers.routers import RouterConfig, router_config
from moe_serve.model_config import (
    MAX_POSITIONS,
    AttentionTemperature,
    ExpertsPerToken,
    FFNConfig,
    LayerAttention,
    ModelConfig,
    MoEConfig,
    RopeScaling,
)
from moe_serve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HFArchitecture:
    moe_prefix: str  # module holding router and experts in a decoder layer
    # our glu linear name -> the checkpoint's per-expert name; None: Granite's fused banks, `input_linear`
    # [N, 2I, D] (gate rows, then up rows) and `output_linear` [N, D, I], beside the router
    expert_names: dict[str, str] | None
    num_experts_keys: tuple[str, ...]  # the first one present counts (names moved between releases)
    expert_size_key: str
    qk_norm: str | None
    router: str = "topk_softmax"  # the router kind (sparsemixer: Phi-3.5-MoE)
    router_name: str = "gate"  # the router linear under moe_prefix
    # (its module in a decoder layer, the config key of its size; 0 or absent: none), laid out as the experts
    shared_expert: tuple[str, str] | None = None
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(x w) scales the shared expert
    has_dense_layers: bool = False  # decoder_sparse_step / mlp_only_layers decide which layers are MoE
    default_norm_topk_prob: bool = False
    default_attention_bias: bool = False
    attention_out_bias: bool = False  # attention_bias also puts a bias on o_proj (Llama-style: Phi, Granite)
    norm: NormKind = "rmsnorm"  # Phi-3.5-MoE: LayerNorm with bias
    rope_types: tuple[str, ...] = ("linear", "yarn")  # rotary scalings served as this family's code computes them
    sliding_window: bool = False  # `sliding_window` applies whenever set (no use_sliding_window switch)
    # Granite: embedding_multiplier, residual_multiplier, attention_multiplier (the softmax scale) and
    # logits_scaling (a divisor), each 1.0 when absent
    multipliers: bool = False
    # gpt-oss: experts `gate_up_proj` [N, D, 2I] (gate and up interleaved along the last axis) and `down_proj`
    # [N, I, D], each with a bias, or the same as MXFP4 `_blocks` and `_scales` (dequantized: exporters.mxfp4);
    # the clamped SwiGLU (swiglu_alpha, swiglu_limit); a router with a bias; per-head attention sinks; and
    # `layer_types` alternating sliding-window and full attention (ModelConfig.layer_attention)
    gpt_oss: bool = False
    # Llama 4: `moe_layers` (or every interleave_moe_layer_step-th layer) MoE, the others dense FFNs; experts
    # `gate_up_proj` [N, D, 2I] (gate columns, then up) and `down_proj` [N, I, D]; router `topk_sigmoid` whose
    # weight scales each expert's input; local-chunk layers with rotary and the L2 q/k norm, global layers
    # without either (`no_rope_layers`), with temperature tuning; rotary on interleaved pairs (q/k rows permuted)
    llama4: bool = False
    # transformers' defaults for keys a released config.json may omit, which change what the model computes
    # (the config class's, so a missing key means here what it means there)
    defaults: tuple[tuple[str, Any], ...] = ()
    dense_prefix: str = "mlp"  # a dense layer's FFN module
    dense_size_key: str = "intermediate_size"  # its width
    # DeepSeek-V2 / V3 (exporters/hf_deepseek.py): multi-head latent attention, first_k_dense_replace dense
    # layers, n_shared_experts always-on experts, router kind grouped_topk (V2 softmax, V3 sigmoid + bias)
    deepseek: Literal["v2", "v3"] | None = None
    # GLM-4.5: DeepSeek-V3's MoE (grouped_topk, dense first layers, shared experts) with ordinary attention,
    # its per-head q/k RMSNorm (use_qk_norm) and partial rotary (partial_rotary_factor: the first rotary_dim
    # dims of each head rotate as halves of their own; the export reorders q/k rows for ModelConfig.rotary_dim)
    glm4_moe: bool = False


GLU_NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
GRANITE = HFArchitecture(
    "block_sparse_moe",
    None,
    ("num_local_experts",),
    "intermediate_size",
    None,
    router_name="router.layer",
    default_norm_topk_prob=True,
    attention_out_bias=True,
    multipliers=True,
)
DEEPSEEK_V2 = HFArchitecture(
    "mlp",
    GLU_NAMES,
    ("n_routed_experts",),
    "moe_intermediate_size",
    None,
    router="grouped_topk",
    attention_out_bias=True,  # attention_bias puts a bias on q_a, kv_a and o_proj
    defaults=(  # DeepseekV2Config's
        ("n_shared_experts", 2),
        ("first_k_dense_replace", 0),
        ("q_lora_rank", 1536),
        ("kv_lora_rank", 512),
        ("qk_nope_head_dim", 128),
        ("qk_rope_head_dim", 64),
        ("v_head_dim", 128),
        ("n_routed_experts", 64),
        ("routed_scaling_factor", 1.0),
        ("norm_topk_prob", False),
        ("topk_method", "greedy"),
        ("max_position_embeddings", 2048),
        ("bos_token_id", 1),
        ("eos_token_id", 2),
        ("rms_norm_eps", 1e-6),
    ),
    deepseek="v2",
)
DEEPSEEK_V3 = dataclasses.replace(
    DEEPSEEK_V2,
    deepseek="v3",
    defaults=(  # DeepseekV3Config's
        ("n_group", 8),
        ("topk_group", 4),
        ("n_shared_experts", 1),
        ("first_k_dense_replace", 3),
        ("q_lora_rank", 1536),
        ("kv_lora_rank", 512),
        ("qk_nope_head_dim", 128),
        ("qk_rope_head_dim", 64),
        ("v_head_dim", 128),
        ("n_routed_experts", 256),
        ("num_experts_per_tok", 8),
        ("routed_scaling_factor", 2.5),
        ("norm_topk_prob", True),
        ("rope_interleave", True),
        ("max_position_embeddings", 4096),
        ("bos_token_id", 0),
        ("eos_token_id", 1),
        ("rms_norm_eps", 1e-6),
    ),
)
ARCHITECTURES: dict[str, HFArchitecture] = {
    "MixtralForCausalLM": HFArchitecture(
        "block_sparse_moe",
        MIXTRAL_NAMES,
        ("num_local_experts",),
        "intermediate_size",
        None,
        default_norm_topk_prob=True,
        sliding_window=True,
    ),
    "Qwen2MoeForCausalLM": HFArchitecture(
        "mlp",
        GLU_NAMES,
        ("num_experts",),
        "moe_intermediate_size",
        None,
        shared_expert=("mlp.shared_expert", "shared_expert_intermediate_size"),
        shared_expert_gate=True,
        has_dense_layers=True,
        default_attention_bias=True,
    ),
    "Qwen3MoeForCausalLM": HFArchitecture(
        "mlp",
        GLU_NAMES,
        ("num_experts", "num_local_experts"),
        "moe_intermediate_size",
        "per_head",
        has_dense_layers=True,
    ),
    "OlmoeForCausalLM": HFArchitecture("mlp", GLU_NAMES, ("num_experts",), "intermediate_size", "full"),
    "PhimoeForCausalLM": HFArchitecture(
        "block_sparse_moe",
        MIXTRAL_NAMES,
        ("num_local_experts",),
        "intermediate_size",
        None,
        router="sparsemixer",
        attention_out_bias=True,
        norm="layernorm",
        # Phimoe's rotary scales cos/sin by short_mscale/long_mscale for any non-default type, so only the
        # type it ships is served (RopeScaling: longrope).
        rope_types=("longrope",),
        sliding_window=True,
    ),
    "GraniteMoeForCausalLM": GRANITE,
    "GraniteMoeSharedForCausalLM": dataclasses.replace(
        GRANITE, shared_expert=("shared_mlp", "shared_intermediate_size")
    ),
    "Llama4ForCausalLM": HFArchitecture(
        "feed_forward",
        GLU_NAMES,
        ("num_local_experts",),
        "intermediate_size",
        "per_head",
        router="topk_sigmoid",
        router_name="router",
        shared_expert=("feed_forward.shared_expert", "intermediate_size"),
        has_dense_layers=True,
        rope_types=("linear", "yarn", "llama3"),
        defaults=(  # Llama4TextConfig's
            ("attention_chunk_size", 8192),
            ("use_qk_norm", True),
            ("attn_temperature_tuning", True),
            ("floor_scale", 8192),
            ("attn_scale", 0.1),
            ("rms_norm_eps", 1e-5),
            ("no_rope_layer_interval", 4),
            ("interleave_moe_layer_step", 1),
            ("rope_parameters", {"rope_type": "default", "rope_theta": 500000.0}),
        ),
        llama4=True,
        dense_prefix="feed_forward",
        dense_size_key="intermediate_size_mlp",
    ),
    "DeepseekV2ForCausalLM": DEEPSEEK_V2,
    "DeepseekV3ForCausalLM": DEEPSEEK_V3,
    "Glm4MoeForCausalLM": HFArchitecture(
        "mlp",
        GLU_NAMES,
        ("n_routed_experts",),
        "moe_intermediate_size",
        "per_head",
        router="grouped_topk",
        shared_expert=("mlp.shared_experts", "n_shared_experts"),  # n_shared_experts of moe_intermediate_size
        defaults=(  # Glm4MoeConfig's
            ("n_group", 1),
            ("topk_group", 1),
            ("norm_topk_prob", True),
            ("routed_scaling_factor", 1.0),
            ("first_k_dense_replace", 1),
            ("n_shared_experts", 1),
            ("use_qk_norm", False),
            ("rms_norm_eps", 1e-5),
            ("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        ),
        glm4_moe=True,
    ),
    "GptOssForCausalLM": HFArchitecture(
        "mlp",
        None,
        ("num_local_experts",),
        "intermediate_size",
        None,
        router_name="router",
        default_norm_topk_prob=True,  # softmax over the top-k logits
        attention_out_bias=True,
        defaults=(  # GptOssConfig's
            ("attention_bias", True),
            ("swiglu_limit", 7.0),
            ("swiglu_alpha", 1.702),
            ("sliding_window", 128),
            ("rms_norm_eps", 1e-5),
            (
                "rope_parameters",
                {
                    "rope_type": "yarn",
                    "factor": 32.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": False,
                    "original_max_position_embeddings": 4096,
                    "rope_theta": 150000.0,
                },
            ),  # fmt: skip
        ),
        gpt_oss=True,
    ),
}
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "relu": "relu",
}


def _architecture(hf: dict[str, Any]) -> tuple[str, HFArchitecture]:
    names = hf.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return name, ARCHITECTURES[name]
    raise ExportError(
        f"unsupported architecture {', '.join(names) or '(none given)'}; supported: {', '.join(ARCHITECTURES)}"
    )


def _resolved(hf: dict[str, Any]) -> tuple[dict[str, Any], HFArchitecture]:
    """The config with its family's defaults (HFArchitecture.defaults) for the keys it omits (a key present as
    null keeps null, as in transformers), and the family. A rotary default applies only where the config
    gives no rotary settings of its own (rope_parameters, or the older rope_scaling and rope_theta)."""
    _, arch = _architecture(hf)
    own_rope = any(key in hf for key in ("rope_parameters", "rope_scaling", "rope_theta"))
    defaults = {key: value for key, value in arch.defaults if not (key == "rope_parameters" and own_rope)}
    return {**defaults, **hf}, arch


def _moe_layers(hf: dict[str, Any], arch: HFArchitecture) -> tuple[int, ...]:
    if arch.deepseek is not None or arch.glm4_moe:  # first_k_dense_replace
        return hf_deepseek.moe_layers(hf)
    layers = range(hf["num_hidden_layers"])
    if not arch.has_dense_layers:
        return tuple(layers)
    if arch.llama4:  # transformers' Llama4TextConfig rule
        step = hf.get("interleave_moe_layer_step", 1) or 1
        return tuple(hf.get("moe_layers") or range(step - 1, hf["num_hidden_layers"], step))
    step = hf.get("decoder_sparse_step", 1) or 1
    dense = set(hf.get("mlp_only_layers") or [])
    return tuple(i for i in layers if i not in dense and (i + 1) % step == 0)


def _rope(hf: dict[str, Any], arch: HFArchitecture) -> tuple[float, RopeScaling | None]:
    params = dict(hf.get("rope_parameters") or {})  # transformers >= 5
    legacy = hf.get("rope_scaling") or {}  # transformers < 5
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = {**legacy, **params}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in arch.rope_types:
        raise ExportError(
            f"rope type '{rope_type}' is not supported for {hf.get('model_type')} (supported: default, "
            f"{', '.join(arch.rope_types)})"
        )
    original = scaling.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    if rope_type == "llama3":
        return theta, RopeScaling(
            type="llama3",
            factor=scaling["factor"],
            original_max_position_embeddings=original,
            low_freq_factor=scaling["low_freq_factor"],
            high_freq_factor=scaling["high_freq_factor"],
        )
    if rope_type == "longrope":
        # Phi-3.5-MoE: transformers scales cos/sin by short_mscale (not attention_factor) for every position
        # below original_max_position_embeddings, with the short factors (RopeScaling says why only those).
        return theta, RopeScaling(
            type="longrope",
            factor=scaling.get("factor") or hf["max_position_embeddings"] / original,
            original_max_position_embeddings=original,
            attention_factor=scaling["short_mscale"],
            short_factor=tuple(scaling["short_factor"]),
        )
    return theta, RopeScaling(
        type=rope_type,
        factor=scaling["factor"],
        original_max_position_embeddings=original,
        beta_fast=scaling.get("beta_fast") or 32.0,
        beta_slow=scaling.get("beta_slow") or 1.0,
        attention_factor=scaling.get("attention_factor"),
        mscale=scaling.get("mscale"),
        mscale_all_dim=scaling.get("mscale_all_dim"),
        truncate=scaling.get("truncate", True),
    )


def _max_positions(hf: dict[str, Any], scaling: RopeScaling | None) -> int:
    """The positions the artifact serves: the source's, capped where only a shorter range is exact."""
    positions = hf.get("max_position_embeddings", 2048)
    if scaling is not None and scaling.type == "longrope":
        original = scaling.original_max_position_embeddings
        assert original is not None  # RopeScaling requires it for longrope
        if positions > original:
            logger.warning(
                "longrope rotary scaling is exact here up to original_max_position_embeddings (%d), where "
                "transformers uses its short factors; max_position_embeddings %d is capped to it",
                original,
                positions,
            )
            return original
    if positions > MAX_POSITIONS:  # Llama 4 Scout declares 10M; the rotary tables are built for every position
        logger.warning(
            "max_position_embeddings %d is above the %d positions an artifact serves; capped to it",
            positions,
            MAX_POSITIONS,
        )
        return MAX_POSITIONS
    return positions


def _check_sliding_window(hf: dict[str, Any], positions: int) -> None:
    """A window that covers every position served changes nothing (Phi-3.5-MoE ships one of 131,072, its whole
    context). A shorter one is served where every layer slides (Mixtral, Phi: _layer_attention) or where
    layer_types say which do (gpt-oss); Qwen's use_sliding_window, with its own rule for which layers slide
    (max_window_layers), is refused."""
    window = hf.get("sliding_window")
    if hf.get("use_sliding_window") and window is not None and window < positions:
        raise ExportError(
            f"sliding-window attention with use_sliding_window is not supported (sliding_window {window}, "
            f"shorter than the {positions} positions served; which layers slide follows max_window_layers)"
        )


def _layer_attention(hf: dict[str, Any], arch: HFArchitecture, positions: int) -> dict[str, Any]:
    """gpt-oss: each layer's `layer_types` entry (sliding_attention: a window of `sliding_window` keys;
    full_attention) and the attention sinks; Llama 4: each layer's chunk, rotary and q/k norm, and the
    temperature tuning of its layers without rotary; as ModelConfig fields."""
    if arch.llama4:
        return _llama4_attention(hf)
    if arch.sliding_window:  # Mixtral, Phi: with sliding_window set, transformers' mask slides in every layer
        window = hf.get("sliding_window")
        if isinstance(window, int) and window < positions:  # a wider one changes nothing served
            return {"layer_attention": (LayerAttention(window=window),) * hf["num_hidden_layers"]}
        return {}
    if not arch.gpt_oss:
        return {}
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


def _llama4_attention(hf: dict[str, Any]) -> dict[str, Any]:
    """Llama4TextConfig's rules: no_rope_layers (1: the layer uses rotary), when empty every
    no_rope_layer_interval-th layer without; layer_types, when absent, chunked on the rotary layers if a
    chunk size is set."""
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


def _expert_ffn(hf: dict[str, Any], arch: HFArchitecture, activation: str) -> FFNConfig:
    if arch.gpt_oss:
        return FFNConfig(
            "glu",
            hf[arch.expert_size_key],
            "swigluoai",
            use_bias=True,
            swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),  # transformers' default where older configs omit it
            swiglu_limit=float(hf["swiglu_limit"]),
        )
    return FFNConfig("glu", hf[arch.expert_size_key], activation)  # type: ignore[arg-type]


def _router(hf: dict[str, Any], arch: HFArchitecture) -> RouterConfig:
    if arch.deepseek is not None:  # grouped_topk
        return hf_deepseek.router(hf, arch.deepseek)
    if arch.glm4_moe:  # DeepSeek-V3's
        return hf_deepseek.router(hf, "v3")
    if arch.router == "sparsemixer":  # eval mode uses router_jitter_noise as its masking threshold
        return router_config(
            "sparsemixer", **({"jitter_eps": hf["router_jitter_noise"]} if "router_jitter_noise" in hf else {})
        )
    if arch.router == "topk_sigmoid":
        return router_config("topk_sigmoid")
    normalize = bool(hf.get("norm_topk_prob", arch.default_norm_topk_prob))
    if arch.gpt_oss:
        return router_config(arch.router, normalize=normalize, use_bias=True)
    return router_config(arch.router, normalize=normalize)


def _max_k(hf: dict[str, Any], arch: HFArchitecture, num_experts: int) -> int:
    """The largest k served: every expert, or for DeepSeek's group-limited routing what its groups kept hold."""
    grouped = arch.deepseek is not None or arch.glm4_moe
    return hf_deepseek.max_k(hf, _router(hf, arch), num_experts) if grouped else num_experts


def _heads(hf: dict[str, Any], arch: HFArchitecture, scaling: RopeScaling | None) -> dict[str, Any]:
    """num_kv_heads and head_dim; DeepSeek: its latent attention's fields (exporters/hf_deepseek.py)."""
    if arch.deepseek is not None:
        return hf_deepseek.model_fields(hf, scaling)
    fields = {
        "num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
        "head_dim": hf.get("head_dim"),
    }
    factor = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if arch.glm4_moe and factor is not None and factor != 1.0:  # transformers: int(head_dim * factor) dims rotate
        head_dim = fields["head_dim"] or hf["hidden_size"] // hf["num_attention_heads"]
        fields["rotary_dim"] = int(head_dim * factor)
    return fields


def _multipliers(hf: dict[str, Any], arch: HFArchitecture) -> dict[str, float]:
    """Granite's scales as ModelConfig fields (absent: transformers' default, 1.0)."""
    if not arch.multipliers:
        return {}
    values = {}
    for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        value = hf.get(key, 1.0)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ExportError(f"config.json: {key} must be a number; got {value!r}")
        values[key] = float(value)
    return {
        "embedding_scale": values["embedding_multiplier"],
        "residual_scale": values["residual_multiplier"],
        "attention_scale": values["attention_multiplier"],  # Granite's softmax scale replaces 1/sqrt(head_dim)
        "logits_divisor": values["logits_scaling"],
    }


def convert_config(
    hf: dict[str, Any], tokenizer: Tokenizer | None = None, chat_template: str | None = None
) -> ModelConfig:
    """A Hugging Face config.json (as a dict) -> ModelConfig."""
    hf, arch = _resolved(hf)
    activation = ACTIVATIONS.get(hf.get("hidden_act", "silu"))
    if activation is None:
        raise ExportError(f"activation '{hf.get('hidden_act')}' is not supported (supported: {', '.join(ACTIVATIONS)})")
    num_experts = next((hf[key] for key in arch.num_experts_keys if key in hf), None)
    if num_experts is None:
        raise ExportError(f"config.json gives no number of experts ({' or '.join(arch.num_experts_keys)})")
    try:
        theta, scaling = _rope(hf, arch)
        positions = _max_positions(hf, scaling)
        _check_sliding_window(hf, positions)
        shared = None
        if arch.shared_expert is not None and hf.get(arch.shared_expert[1]):
            shared = FFNConfig("glu", hf[arch.shared_expert[1]], activation)
        if arch.deepseek is not None or arch.glm4_moe:  # n_shared_experts of moe_intermediate_size
            shared = hf_deepseek.shared_expert(hf, activation)
        moe = MoEConfig(
            weights_scale_input=arch.llama4,
            num_experts=num_experts,
            layers=_moe_layers(hf, arch),
            expert=_expert_ffn(hf, arch, activation),
            router=_router(hf, arch),
            experts_per_token=ExpertsPerToken(
                default=hf["num_experts_per_tok"], min=1, max=_max_k(hf, arch, num_experts)
            ),
            shared_expert=shared,
            shared_expert_gate=shared is not None and arch.shared_expert_gate,
        )
    except (ConfigError, KeyError) as exc:
        raise ExportError(f"config.json: {exc}") from None
    vocab_size = hf["vocab_size"]
    eos = hf.get("eos_token_id")
    eos_ids = tuple(e for e in (eos if isinstance(eos, list) else [eos]) if e is not None and 0 <= e < vocab_size)
    if eos is not None and not eos_ids:
        logger.warning(
            "eos_token_id %s is outside the vocabulary (%d); generation stops only at max_tokens", eos, vocab_size
        )
    bos = hf.get("bos_token_id")
    bos = bos if isinstance(bos, int) and 0 <= bos < vocab_size else None
    attention_bias = bool(hf.get("qkv_bias", hf.get("attention_bias", arch.default_attention_bias)))
    try:
        return ModelConfig(
            task="causal_lm",
            vocab_size=vocab_size,
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            **_heads(hf, arch, scaling),
            attention_bias=attention_bias,
            attention_out_bias=attention_bias and arch.attention_out_bias,
            ffn=FFNConfig("glu", hf.get(arch.dense_size_key, hf[arch.expert_size_key]), activation),
            moe=moe,
            position="rotary",
            max_position_embeddings=positions,
            rope_theta=theta,
            rope_scaling=scaling,
            qk_norm=None if (arch.llama4 or arch.glm4_moe) and not hf.get("use_qk_norm") else arch.qk_norm,  # type: ignore[arg-type]
            qkv_clip=hf.get("clip_qkv"),
            norm=arch.norm,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            norm_position="pre",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            lm_head_bias=bool(hf.get("lm_head_bias", False)),
            bos_token_id=bos,
            eos_token_id=(eos_ids[0] if len(eos_ids) == 1 else eos_ids) if eos_ids else None,
            add_bos_token=bos is not None and tokenizer is not None and _tokenizer_adds_bos(tokenizer, bos),
            chat_template=chat_template,
            **_multipliers(hf, arch),  # type: ignore[arg-type]
            **_layer_attention(hf, arch, positions),
        )
    except (ConfigError, KeyError) as exc:
        raise ExportError(f"config.json: {exc}") from None


def _tokenizer_adds_bos(tokenizer: Tokenizer, bos: int) -> bool:
    """Whether the source tokenizer's post-processor puts BOS in front of encoded text."""
    ids = tokenizer.encode_with_special_tokens("a")
    return bool(ids) and ids[0] == bos


def convert_weights(
    hf: dict[str, Any], config: ModelConfig, checkpoint: SafetensorsCheckpoint, *, progress: bool = True
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under canonical names, experts stacked; every key and shape checked."""
    hf, arch = _resolved(hf)
    assert config.moe is not None and config.head_dim is not None and config.num_kv_heads is not None
    d, n = config.hidden_size, config.moe.num_experts
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    out: dict[str, torch.Tensor] = {
        "embed_tokens.weight": checkpoint.get("model.embed_tokens.weight", (config.vocab_size, d))
    }
    norm_parts = ("weight", "bias") if config.norm == "layernorm" else ("weight",)

    def norm(src: str, dst: str) -> None:
        for part in norm_parts:
            out[f"{dst}.{part}"] = checkpoint.get(f"{src}.{part}", (d,))

    norm("model.norm", "norm")
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = checkpoint.get("lm_head.weight", (config.vocab_size, d))
    if config.lm_head_bias:  # a tied head keeps its own bias (an artifact names it lm_head_bias)
        name = "lm_head_bias" if config.tie_word_embeddings else "lm_head.bias"
        out[name] = checkpoint.get("lm_head.bias", (config.vocab_size,))
    for i in tqdm(range(config.num_layers), desc="export", unit="layer", disable=not progress):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        norm(src + "input_layernorm", dst + "attn_norm")
        norm(src + "post_attention_layernorm", dst + "ffn_norm")
        if arch.deepseek is not None:  # latent attention, then its MoE layout (exporters/hf_deepseek.py)
            out.update(hf_deepseek.layer_weights(checkpoint, hf, arch, config, i))
            continue
        for name, rows in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            out[dst + f"attn.{name}.weight"] = checkpoint.get(src + f"self_attn.{name}.weight", (rows, d))
            if config.attention_bias:
                out[dst + f"attn.{name}.bias"] = checkpoint.get(src + f"self_attn.{name}.bias", (rows,))
            if name == "v_proj":
                continue
            if arch.llama4:
                out[dst + f"attn.{name}.weight"] = _pairs_to_halves(out[dst + f"attn.{name}.weight"], config.head_dim)
            if config.rotary_dim is not None:  # GLM-4.5's partial rotary: every row of a head, bias included
                for part in ("weight", "bias") if config.attention_bias else ("weight",):
                    key = dst + f"attn.{name}.{part}"
                    out[key] = _partial_rotary_rows(out[key], config.head_dim, config.rotary_dim)
        out[dst + "attn.o_proj.weight"] = checkpoint.get(src + "self_attn.o_proj.weight", (d, q_out))
        if config.attention_out_bias:
            out[dst + "attn.o_proj.bias"] = checkpoint.get(src + "self_attn.o_proj.bias", (d,))
        if config.attention_sinks:
            out[dst + "attn.sinks"] = checkpoint.get(src + "self_attn.sinks", (config.num_heads,))
        if config.qk_norm is None or not config.attention_of(i).qk_norm:
            pass
        elif arch.llama4:
            # its L2 norm after rotary: RMSNorm with unit weights (it has none), which commutes with a rotation
            out[dst + "attn.q_norm.weight"] = torch.ones(config.head_dim)
            out[dst + "attn.k_norm.weight"] = torch.ones(config.head_dim)
        else:
            q_dim, k_dim = (config.head_dim, config.head_dim) if config.qk_norm == "per_head" else (q_out, kv_out)
            out[dst + "attn.q_norm.weight"] = checkpoint.get(src + "self_attn.q_norm.weight", (q_dim,))
            out[dst + "attn.k_norm.weight"] = checkpoint.get(src + "self_attn.k_norm.weight", (k_dim,))
            if config.rotary_dim is not None:  # a per-head norm's weights follow the rows they scale
                for which in ("q", "k"):
                    key = dst + f"attn.{which}_norm.weight"
                    out[key] = _partial_rotary_rows(out[key], config.head_dim, config.rotary_dim)
        if i in config.moe.layers:
            moe = src + arch.moe_prefix + "."
            out[dst + "moe.router.weight"] = checkpoint.get(f"{moe}{arch.router_name}.weight", (n, d))
            if config.moe.router.use_bias:
                out[dst + "moe.router.bias"] = checkpoint.get(f"{moe}{arch.router_name}.bias", (n,))
            if getattr(config.moe.router, "correction_bias", False):  # GLM-4.5: DeepSeek-V3's selection bias
                bias = f"{moe}{arch.router_name}.e_score_correction_bias"
                out[dst + "moe.router.correction_bias"] = checkpoint.get(bias, (n,))
            out.update(_experts(checkpoint, moe, dst + "moe.experts.", arch, n, d, config.moe.expert.intermediate_size))
            shared = config.moe.shared_expert
            if shared is not None:
                assert arch.shared_expert is not None
                shared_src = f"{src}{arch.shared_expert[0]}."
                if arch.expert_names is None:  # Granite: the shared MLP fused as its experts are
                    out.update(
                        _fused_glu(checkpoint, shared_src, dst + "moe.shared_expert.", (), d, shared.intermediate_size)
                    )
                else:
                    out.update(
                        _glu(checkpoint, shared_src, dst + "moe.shared_expert.", GLU_NAMES, d, shared.intermediate_size)
                    )
            if config.moe.shared_expert_gate:
                out[dst + "moe.shared_expert_gate.weight"] = checkpoint.get(moe + "shared_expert_gate.weight", (1, d))
        else:
            dense = f"{src}{arch.dense_prefix}."
            out.update(_glu(checkpoint, dense, dst + "ffn.", GLU_NAMES, d, config.ffn.intermediate_size))
    return out


def _glu(
    checkpoint: SafetensorsCheckpoint, src: str, dst: str, names: dict[str, str], d: int, i: int
) -> dict[str, torch.Tensor]:
    shapes = {"gate_proj": (i, d), "up_proj": (i, d), "down_proj": (d, i)}
    return {
        f"{dst}{ours}.weight": checkpoint.get(f"{src}{theirs}.weight", shapes[ours]) for ours, theirs in names.items()
    }


def _fused_glu(
    checkpoint: SafetensorsCheckpoint, src: str, dst: str, bank: tuple[int, ...], d: int, i: int
) -> dict[str, torch.Tensor]:
    """Granite's layout, for its experts (bank = (N,)) and its shared MLP (bank = ()): input_linear holds the
    gate rows then the up rows (transformers chunks its output in two, gate first), output_linear the down."""
    gate_up = checkpoint.get(src + "input_linear.weight", (*bank, 2 * i, d))
    return {
        dst + "gate_proj.weight": gate_up[..., :i, :].contiguous(),
        dst + "up_proj.weight": gate_up[..., i:, :].contiguous(),
        dst + "down_proj.weight": checkpoint.get(src + "output_linear.weight", (*bank, d, i)),
    }


def _experts(
    checkpoint: SafetensorsCheckpoint, moe: str, dst: str, arch: HFArchitecture, n: int, d: int, i: int
) -> dict[str, torch.Tensor]:
    if arch.gpt_oss:
        return _gpt_oss_experts(checkpoint, moe + "experts.", dst, n, d, i)
    if arch.llama4:  # [N, in, out]: gate columns, then up
        gate_up = checkpoint.get(moe + "experts.gate_up_proj", (n, d, 2 * i)).transpose(1, 2)
        return {
            dst + "gate_proj.weight": gate_up[:, :i].contiguous(),
            dst + "up_proj.weight": gate_up[:, i:].contiguous(),
            dst + "down_proj.weight": checkpoint.get(moe + "experts.down_proj", (n, i, d)).transpose(1, 2).contiguous(),
        }
    if arch.expert_names is None:
        return _fused_glu(checkpoint, moe, dst, (n,), d, i)
    src = moe + "experts."
    if src + "gate_up_proj" in checkpoint:  # transformers 5's fused in-memory layout, if saved as such
        gate_up = checkpoint.get(src + "gate_up_proj", (n, 2 * i, d))
        return {
            dst + "gate_proj.weight": gate_up[:, :i].contiguous(),
            dst + "up_proj.weight": gate_up[:, i:].contiguous(),
            dst + "down_proj.weight": checkpoint.get(src + "down_proj", (n, d, i)),
        }
    per_expert = [_glu(checkpoint, f"{src}{e}.", "", arch.expert_names, d, i) for e in range(n)]
    return {f"{dst}{name}": torch.stack([p[name] for p in per_expert]) for name in per_expert[0]}


def _reorder_heads(rows: torch.Tensor, head_dim: int, order: torch.Tensor) -> torch.Tensor:
    """Rows of a q or k projection (or its bias, or a per-head norm's weights), each head's head_dim rows taken in
    `order`. The same reorder on q and k leaves every q . k, the per-head norms and the output as they were."""
    return rows.reshape(-1, head_dim, *rows.shape[1:])[:, order].reshape(rows.shape).contiguous()


def _pairs_to_halves(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Llama 4 rotates interleaved pairs (x0, x1), (x2, x3), ... as complex numbers: its heads' rows put in the
    order of rotary on halves (x_j with x_{j + Dh/2})."""
    return _reorder_heads(weight, head_dim, hf_deepseek.interleaved_to_halves(head_dim))


def _partial_rotary_rows(rows: torch.Tensor, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """GLM-4.5's order (the first rotary_dim dims of a head rotate as two halves, the rest pass through) ->
    ModelConfig.rotary_dim's: rotated halves at 0 and head_dim / 2, each followed by half of the pass-through."""
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    order = torch.cat(
        [
            torch.arange(0, r),
            torch.arange(rotary_dim, rotary_dim + p),
            torch.arange(r, rotary_dim),
            torch.arange(rotary_dim + p, head_dim),
        ]
    )
    return _reorder_heads(rows, head_dim, order)


def _gpt_oss_experts(
    checkpoint: SafetensorsCheckpoint, src: str, dst: str, n: int, d: int, i: int
) -> dict[str, torch.Tensor]:
    """gpt-oss's banks (the float layout transformers saves, [N, in, out] with gate and up interleaved; or the
    released MXFP4 blocks and scales, [N, out, in / 32, 16], dequantized to float32) -> [N, out, in] banks."""
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


def export_hf(src: str | Path, dst: str | Path, options: ExportOptions = DEFAULT_OPTIONS) -> Path:
    """Export a Hugging Face MoE directory. Everything is read and checked before DST is written."""
    src = Path(src)
    if not src.is_dir():
        raise ExportError(f"{src} is not a directory")
    hf, prefix = _text_model(read_json(src / "config.json"))
    hf, _ = _resolved(hf)
    name, _ = _architecture(hf)
    if not (src / "tokenizer.json").is_file():
        raise ExportError(
            f"{src} has no tokenizer.json (only fast tokenizers in tokenizers' JSON format are carried over)"
        )
    tokenizer = Tokenizer.from_file(src / "tokenizer.json")
    config = convert_config(hf, tokenizer, _chat_template(src))
    checkpoint = SafetensorsCheckpoint.from_directory(src)
    if prefix:
        checkpoint = checkpoint.under(prefix)
    state = convert_weights(hf, config, checkpoint, progress=options.progress)
    provenance = {
        "exporter": "exporters.hf",
        "source_architecture": name,
        "source_sha256": checkpoint.sha256(),
        "trained_experts_per_token": hf["num_experts_per_tok"],
        "folded": "experts stacked into [N, out, in] banks; routing convention kept "
        f"({config.moe.router.describe() if config.moe else None})",
    }
    return write(dst, config, state, tokenizer, provenance, options)


# Multimodal checkpoints whose text model is a family above: its architecture, and where its tensors sit.
TEXT_MODELS = {"Llama4ForConditionalGeneration": ("Llama4ForCausalLM", "language_model.")}


def _text_model(hf: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A multimodal config.json -> its text model's config (as that architecture) and the prefix of its tensors
    in the checkpoint; any other config as it is, with no prefix. Only text is served: the vision tower and
    projector are not read."""
    for name in hf.get("architectures") or []:
        if name in TEXT_MODELS:
            text, prefix = TEXT_MODELS[name]
            if not isinstance(hf.get("text_config"), dict):
                raise ExportError(f"config.json: {name} needs a text_config object")
            logger.warning("%s: exporting its text model only (images are not served)", name)
            return {**hf["text_config"], "architectures": [text]}, prefix
    return hf, ""


def _chat_template(src: Path) -> str | None:
    if (src / "chat_template.jinja").is_file():
        return (src / "chat_template.jinja").read_text()
    if (src / "tokenizer_config.json").is_file():
        template = read_json(src / "tokenizer_config.json").get("chat_template")
        return template if isinstance(template, str) else None
    return None
