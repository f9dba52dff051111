"""Hugging Face MoE directories (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) -> moe-serve artifacts.

Weights are mapped by name (the tables below are the whole mapping) and experts are stacked into
[N, out, in] banks. Each model keeps its routing convention: Mixtral renormalises the top-k weights
(`topk_softmax`, normalize=true); Qwen and OLMoE follow `norm_topk_prob` (false: raw softmax mass).
The trained `num_experts_per_tok` becomes the default k; requests may choose any k in 1..N.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from moe_serve.errors import ConfigError
from moe_serve.exporters.base import (
    DEFAULT_OPTIONS,
    ExportError,
    ExportOptions,
    SafetensorsCheckpoint,
    read_json,
    write,
)
from moe_serve.layers.routers import router_config
from moe_serve.model_config import ExpertsPerToken, FFNConfig, ModelConfig, MoEConfig, RopeScaling
from moe_serve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HFArchitecture:
    moe_prefix: str  # module holding router and experts in a decoder layer
    expert_names: dict[str, str]  # our glu linear name -> the checkpoint's per-expert name
    num_experts_keys: tuple[str, ...]  # the first one present counts (names moved between releases)
    expert_size_key: str
    qk_norm: str | None
    has_shared_expert: bool = False
    has_dense_layers: bool = False  # decoder_sparse_step / mlp_only_layers decide which layers are MoE
    default_norm_topk_prob: bool = False
    default_attention_bias: bool = False


GLU_NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
ARCHITECTURES: dict[str, HFArchitecture] = {
    "MixtralForCausalLM": HFArchitecture(
        "block_sparse_moe",
        {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
        ("num_local_experts",),
        "intermediate_size",
        None,
        default_norm_topk_prob=True,
    ),
    "Qwen2MoeForCausalLM": HFArchitecture(
        "mlp",
        GLU_NAMES,
        ("num_experts",),
        "moe_intermediate_size",
        None,
        has_shared_expert=True,
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


def _moe_layers(hf: dict[str, Any], arch: HFArchitecture) -> tuple[int, ...]:
    layers = range(hf["num_hidden_layers"])
    if not arch.has_dense_layers:
        return tuple(layers)
    step = hf.get("decoder_sparse_step", 1) or 1
    dense = set(hf.get("mlp_only_layers") or [])
    return tuple(i for i in layers if i not in dense and (i + 1) % step == 0)


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    params = dict(hf.get("rope_parameters") or {})  # transformers >= 5
    legacy = hf.get("rope_scaling") or {}  # transformers < 5
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = {**legacy, **params}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ("linear", "yarn"):
        raise ExportError(f"rope type '{rope_type}' is not supported (supported: default, linear, yarn)")
    return theta, RopeScaling(
        type=rope_type,
        factor=scaling["factor"],
        original_max_position_embeddings=scaling.get("original_max_position_embeddings"),
        beta_fast=scaling.get("beta_fast") or 32.0,
        beta_slow=scaling.get("beta_slow") or 1.0,
        attention_factor=scaling.get("attention_factor"),
        mscale=scaling.get("mscale"),
        mscale_all_dim=scaling.get("mscale_all_dim"),
        truncate=scaling.get("truncate", True),
    )


def convert_config(
    hf: dict[str, Any], tokenizer: Tokenizer | None = None, chat_template: str | None = None
) -> ModelConfig:
    """A Hugging Face config.json (as a dict) -> ModelConfig."""
    _, arch = _architecture(hf)
    if hf.get("use_sliding_window") or (hf.get("sliding_window") and hf.get("model_type") == "mixtral"):
        raise ExportError("sliding-window attention is not supported; this checkpoint enables it (sliding_window)")
    activation = ACTIVATIONS.get(hf.get("hidden_act", "silu"))
    if activation is None:
        raise ExportError(f"activation '{hf.get('hidden_act')}' is not supported (supported: {', '.join(ACTIVATIONS)})")
    num_experts = next((hf[key] for key in arch.num_experts_keys if key in hf), None)
    if num_experts is None:
        raise ExportError(f"config.json gives no number of experts ({' or '.join(arch.num_experts_keys)})")
    theta, scaling = _rope(hf)
    shared = None
    if arch.has_shared_expert and hf.get("shared_expert_intermediate_size"):
        shared = FFNConfig("glu", hf["shared_expert_intermediate_size"], activation)
    moe = MoEConfig(
        num_experts=num_experts,
        layers=_moe_layers(hf, arch),
        expert=FFNConfig("glu", hf[arch.expert_size_key], activation),
        router=router_config("topk_softmax", normalize=bool(hf.get("norm_topk_prob", arch.default_norm_topk_prob))),
        experts_per_token=ExpertsPerToken(default=hf["num_experts_per_tok"], min=1, max=num_experts),
        shared_expert=shared,
        shared_expert_gate=shared is not None,
    )
    vocab_size = hf["vocab_size"]
    eos = hf.get("eos_token_id")
    eos_ids = tuple(e for e in (eos if isinstance(eos, list) else [eos]) if e is not None and 0 <= e < vocab_size)
    if eos is not None and not eos_ids:
        logger.warning(
            "eos_token_id %s is outside the vocabulary (%d); generation stops only at max_tokens", eos, vocab_size
        )
    bos = hf.get("bos_token_id")
    bos = bos if isinstance(bos, int) and 0 <= bos < vocab_size else None
    try:
        return ModelConfig(
            task="causal_lm",
            vocab_size=vocab_size,
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"),
            attention_bias=bool(hf.get("qkv_bias", hf.get("attention_bias", arch.default_attention_bias))),
            ffn=FFNConfig("glu", hf.get("intermediate_size", hf[arch.expert_size_key]), activation),
            moe=moe,
            position="rotary",
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rope_theta=theta,
            rope_scaling=scaling,
            qk_norm=arch.qk_norm,  # type: ignore[arg-type]
            qkv_clip=hf.get("clip_qkv"),
            norm="rmsnorm",
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            norm_position="pre",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=bos,
            eos_token_id=(eos_ids[0] if len(eos_ids) == 1 else eos_ids) if eos_ids else None,
            add_bos_token=bos is not None and tokenizer is not None and _tokenizer_adds_bos(tokenizer, bos),
            chat_template=chat_template,
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
    _, arch = _architecture(hf)
    assert config.moe is not None and config.head_dim is not None and config.num_kv_heads is not None
    d, n = config.hidden_size, config.moe.num_experts
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    out: dict[str, torch.Tensor] = {
        "embed_tokens.weight": checkpoint.get("model.embed_tokens.weight", (config.vocab_size, d))
    }
    out["norm.weight"] = checkpoint.get("model.norm.weight", (d,))
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = checkpoint.get("lm_head.weight", (config.vocab_size, d))
    bias = config.attention_bias
    for i in tqdm(range(config.num_layers), desc="export", unit="layer", disable=not progress):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        out[dst + "attn_norm.weight"] = checkpoint.get(src + "input_layernorm.weight", (d,))
        out[dst + "ffn_norm.weight"] = checkpoint.get(src + "post_attention_layernorm.weight", (d,))
        for name, rows in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            out[dst + f"attn.{name}.weight"] = checkpoint.get(src + f"self_attn.{name}.weight", (rows, d))
            if bias:
                out[dst + f"attn.{name}.bias"] = checkpoint.get(src + f"self_attn.{name}.bias", (rows,))
        out[dst + "attn.o_proj.weight"] = checkpoint.get(src + "self_attn.o_proj.weight", (d, q_out))
        if config.qk_norm is not None:
            q_dim, k_dim = (config.head_dim, config.head_dim) if config.qk_norm == "per_head" else (q_out, kv_out)
            out[dst + "attn.q_norm.weight"] = checkpoint.get(src + "self_attn.q_norm.weight", (q_dim,))
            out[dst + "attn.k_norm.weight"] = checkpoint.get(src + "self_attn.k_norm.weight", (k_dim,))
        if i in config.moe.layers:
            moe = src + arch.moe_prefix + "."
            out[dst + "moe.router.weight"] = checkpoint.get(moe + "gate.weight", (n, d))
            out.update(
                _experts(
                    checkpoint, moe + "experts.", dst + "moe.experts.", arch, n, d, config.moe.expert.intermediate_size
                )
            )
            if config.moe.shared_expert is not None:
                out.update(
                    _glu(
                        checkpoint,
                        moe + "shared_expert.",
                        dst + "moe.shared_expert.",
                        GLU_NAMES,
                        d,
                        config.moe.shared_expert.intermediate_size,
                    )
                )
                out[dst + "moe.shared_expert_gate.weight"] = checkpoint.get(moe + "shared_expert_gate.weight", (1, d))
        else:
            out.update(_glu(checkpoint, src + "mlp.", dst + "ffn.", GLU_NAMES, d, config.ffn.intermediate_size))
    return out


def _glu(
    checkpoint: SafetensorsCheckpoint, src: str, dst: str, names: dict[str, str], d: int, i: int
) -> dict[str, torch.Tensor]:
    shapes = {"gate_proj": (i, d), "up_proj": (i, d), "down_proj": (d, i)}
    return {
        f"{dst}{ours}.weight": checkpoint.get(f"{src}{theirs}.weight", shapes[ours]) for ours, theirs in names.items()
    }


def _experts(
    checkpoint: SafetensorsCheckpoint, src: str, dst: str, arch: HFArchitecture, n: int, d: int, i: int
) -> dict[str, torch.Tensor]:
    if src + "gate_up_proj" in checkpoint:  # transformers 5's fused in-memory layout, if saved as such
        gate_up = checkpoint.get(src + "gate_up_proj", (n, 2 * i, d))
        return {
            dst + "gate_proj.weight": gate_up[:, :i].contiguous(),
            dst + "up_proj.weight": gate_up[:, i:].contiguous(),
            dst + "down_proj.weight": checkpoint.get(src + "down_proj", (n, d, i)),
        }
    per_expert = [_glu(checkpoint, f"{src}{e}.", "", arch.expert_names, d, i) for e in range(n)]
    return {f"{dst}{name}": torch.stack([p[name] for p in per_expert]) for name in per_expert[0]}


def export_hf(src: str | Path, dst: str | Path, options: ExportOptions = DEFAULT_OPTIONS) -> Path:
    """Export a Hugging Face MoE directory. Everything is read and checked before DST is written."""
    src = Path(src)
    if not src.is_dir():
        raise ExportError(f"{src} is not a directory")
    hf = read_json(src / "config.json")
    name, _ = _architecture(hf)
    if not (src / "tokenizer.json").is_file():
        raise ExportError(
            f"{src} has no tokenizer.json (only fast tokenizers in tokenizers' JSON format are carried over)"
        )
    tokenizer = Tokenizer.from_file(src / "tokenizer.json")
    config = convert_config(hf, tokenizer, _chat_template(src))
    checkpoint = SafetensorsCheckpoint.from_directory(src)
    state = convert_weights(hf, config, checkpoint, progress=options.progress)
    provenance = {
        "exporter": "exporters.hf",
        "source_architecture": name,
        "source_sha256": checkpoint.sha256(),
        "trained_experts_per_token": hf["num_experts_per_tok"],
        "folded": "per-expert linears stacked into [N, out, in] banks; routing convention kept "
        f"(normalize={config.moe.router.normalize if config.moe else None})",
    }
    return write(dst, config, state, tokenizer, provenance, options)


def _chat_template(src: Path) -> str | None:
    if (src / "chat_template.jinja").is_file():
        return (src / "chat_template.jinja").read_text()
    if (src / "tokenizer_config.json").is_file():
        template = read_json(src / "tokenizer_config.json").get("chat_template")
        return template if isinstance(template, str) else None
    return None
