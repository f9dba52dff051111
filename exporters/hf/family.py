"""The family template of the Hugging Face importer, and the registry of families.

`HFFamily` converts one family's directories as transformers computes that family in eval mode: config.json
into a ModelConfig (`model_config`) and the checkpoint's tensors into the artifact's (`state_dict`), every key
and shape checked. The class attributes say what a family's configs and checkpoints call things; the methods
are the steps, which a family overrides only where its model computes something its own way:

- config: `rope` / `rope_scaling` (rotary types), `max_positions`, `heads` (num_kv_heads, head_dim and what
  else attention needs), `scales` (multipliers), `layer_attention` (windows, chunks, sinks), `moe_layers`,
  `router`, `max_k`, `expert_ffn`, `shared_expert`;
- tensors: `attention_weights`, `qk_rows` (the rotary row reorders of moe_serve.exporters.hf.reorder),
  `qk_norm_weights`, `experts`, `shared_expert_weights`.

A family is a subclass with `@register`, which files it under its architecture names; families() lists the
registered ones by display name.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import torch
from tqdm.auto import tqdm

from moe_serve.errors import ConfigError
from moe_serve.exporters.base import ExportError, SafetensorsCheckpoint
from moe_serve.layers.routers import RouterConfig, router_config
from moe_serve.model_config import (
    MAX_POSITIONS,
    Activation,
    ExpertsPerToken,
    FFNConfig,
    ModelConfig,
    MoEConfig,
    NormKind,
    QKNorm,
    RopeScaling,
    RopeType,
)
from moe_serve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

ACTIVATIONS: dict[str, Activation] = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "relu": "relu",
}
# the artifact's GLU linear name -> the checkpoint's, for the families that name them as transformers' Llama does
GLU_NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


class HFFamily:
    """One Hugging Face family: what its config.json and checkpoint say, and how each becomes the artifact's.
    Registered families are used as one instance each (they hold no state)."""

    # ---- what the registry and the documents read ------------------------------------------------------
    name: ClassVar[str]  # the display name the documents list (`family_names`)
    architectures: ClassVar[tuple[str, ...]]  # the config.json `architectures` entries converted as this family
    aliases: ClassVar[tuple[str, ...]] = ()  # display names of other models released in this architecture
    # multimodal architectures whose text model is this family -> the prefix of its tensors in the checkpoint
    text_models: ClassVar[Mapping[str, str]] = {}

    # ---- config.json -----------------------------------------------------------------------------------
    # transformers' defaults for keys a released config.json may omit, which change what the model computes
    # (the config class's, so a missing key means here what it means there)
    defaults: ClassVar[Mapping[str, Any]] = {}
    num_experts_keys: ClassVar[tuple[str, ...]]  # the first one present counts (names moved between releases)
    expert_size_key: ClassVar[str]
    dense_size_key: ClassVar[str] = "intermediate_size"  # a dense layer's FFN width (absent: the experts')
    shared_expert_size_key: ClassVar[str | None] = None  # 0 or absent in a config: no shared expert
    shared_expert_gate: ClassVar[bool] = False  # Qwen2-MoE: sigmoid(x w) scales the shared expert
    weights_scale_input: ClassVar[bool] = False  # MoEConfig.weights_scale_input (Llama 4)
    default_norm_topk_prob: ClassVar[bool] = False
    default_attention_bias: ClassVar[bool] = False
    attention_out_bias: ClassVar[bool] = False  # attention_bias also puts a bias on o_proj (Llama-style: Phi)
    qk_norm: ClassVar[QKNorm | None] = None
    qk_norm_key: ClassVar[str | None] = None  # the config key that turns the q/k norm on (None: always on)
    norm: ClassVar[NormKind] = "rmsnorm"
    # the rotary scalings served besides default: those this family's transformers code computes as RopeScaling does
    rope_types: ClassVar[tuple[str, ...]] = ("linear", "yarn")

    # ---- the checkpoint ----------------------------------------------------------------------------------
    moe_prefix: ClassVar[str]  # the module holding router and experts in a decoder layer
    router_name: ClassVar[str] = "gate"  # the router linear under moe_prefix
    expert_names: ClassVar[Mapping[str, str]] = GLU_NAMES  # each expert's linears, by the artifact's name
    shared_expert_prefix: ClassVar[str | None] = None  # its module in a decoder layer, laid out as GLU_NAMES
    dense_prefix: ClassVar[str] = "mlp"  # a dense layer's FFN module

    def with_defaults(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The config with this family's defaults for the keys it omits (a key present as null keeps null, as in
        transformers). A rotary default applies only where the config gives no rotary settings of its own
        (rope_parameters, or the older rope_scaling and rope_theta)."""
        own_rope = any(key in hf for key in ("rope_parameters", "rope_scaling", "rope_theta"))
        defaults = {key: value for key, value in self.defaults.items() if not (key == "rope_parameters" and own_rope)}
        return {**defaults, **hf}

    # ---- config.json -> ModelConfig --------------------------------------------------------------------

    def model_config(
        self, hf: dict[str, Any], tokenizer: Tokenizer | None = None, chat_template: str | None = None
    ) -> ModelConfig:
        """A config.json (its defaults applied: with_defaults) -> ModelConfig."""
        activation = ACTIVATIONS.get(hf.get("hidden_act", "silu"))
        if activation is None:
            raise ExportError(
                f"activation '{hf.get('hidden_act')}' is not supported (supported: {', '.join(ACTIVATIONS)})"
            )
        num_experts = next((hf[key] for key in self.num_experts_keys if key in hf), None)
        if num_experts is None:
            raise ExportError(f"config.json gives no number of experts ({' or '.join(self.num_experts_keys)})")
        try:
            theta, scaling = self.rope(hf)
            positions = self.max_positions(hf, scaling)
            check_sliding_window(hf, positions)
            shared = self.shared_expert(hf, activation)
            moe = MoEConfig(
                weights_scale_input=self.weights_scale_input,
                num_experts=num_experts,
                layers=self.moe_layers(hf),
                expert=self.expert_ffn(hf, activation),
                router=self.router(hf),
                experts_per_token=ExpertsPerToken(
                    default=hf["num_experts_per_tok"], min=1, max=self.max_k(hf, num_experts)
                ),
                shared_expert=shared,
                shared_expert_gate=shared is not None and self.shared_expert_gate,
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
        attention_bias = bool(hf.get("qkv_bias", hf.get("attention_bias", self.default_attention_bias)))
        qk_norm = None if self.qk_norm_key is not None and not hf.get(self.qk_norm_key) else self.qk_norm
        try:
            return ModelConfig(
                task="causal_lm",
                vocab_size=vocab_size,
                hidden_size=hf["hidden_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=hf["num_attention_heads"],
                **self.heads(hf, scaling),
                attention_bias=attention_bias,
                attention_out_bias=attention_bias and self.attention_out_bias,
                ffn=FFNConfig("glu", hf.get(self.dense_size_key, hf[self.expert_size_key]), activation),
                moe=moe,
                position="rotary",
                max_position_embeddings=positions,
                rope_theta=theta,
                rope_scaling=scaling,
                qk_norm=qk_norm,
                qkv_clip=hf.get("clip_qkv"),
                norm=self.norm,
                norm_eps=hf.get("rms_norm_eps", 1e-6),
                norm_position="pre",
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                lm_head_bias=bool(hf.get("lm_head_bias", False)),
                bos_token_id=bos,
                eos_token_id=(eos_ids[0] if len(eos_ids) == 1 else eos_ids) if eos_ids else None,
                add_bos_token=bos is not None and tokenizer is not None and _tokenizer_adds_bos(tokenizer, bos),
                chat_template=chat_template,
                **self.scales(hf),
                **self.layer_attention(hf, positions),
            )
        except (ConfigError, KeyError) as exc:
            raise ExportError(f"config.json: {exc}") from None

    def rope(self, hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
        """rope_theta and the rotary scaling, from rope_parameters (transformers >= 5) over the older rope_scaling
        and rope_theta; a type outside rope_types is refused, naming the ones served."""
        params = dict(hf.get("rope_parameters") or {})  # transformers >= 5
        legacy = hf.get("rope_scaling") or {}  # transformers < 5
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        settings = {**legacy, **params}
        rope_type = settings.get("rope_type", settings.get("type", "default"))
        if rope_type == "default":
            return theta, None
        if rope_type not in self.rope_types:
            raise ExportError(
                f"rope type '{rope_type}' is not supported for {hf.get('model_type')} (supported: default, "
                f"{', '.join(self.rope_types)})"
            )
        original = settings.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
        return theta, self.rope_scaling(rope_type, settings, original, hf)

    def rope_scaling(
        self, rope_type: RopeType, settings: dict[str, Any], original: int | None, hf: dict[str, Any]
    ) -> RopeScaling:
        """A rotary scaling of one of rope_types (settings: the rope parameters; original: its
        original_max_position_embeddings): linear or yarn, as transformers' rope functions read them."""
        return RopeScaling(
            type=rope_type,
            factor=settings["factor"],
            original_max_position_embeddings=original,
            beta_fast=settings.get("beta_fast") or 32.0,
            beta_slow=settings.get("beta_slow") or 1.0,
            attention_factor=settings.get("attention_factor"),
            mscale=settings.get("mscale"),
            mscale_all_dim=settings.get("mscale_all_dim"),
            truncate=settings.get("truncate", True),
        )

    def max_positions(self, hf: dict[str, Any], scaling: RopeScaling | None) -> int:
        """The positions the artifact serves: the source's, capped where only a shorter range is exact."""
        positions = hf.get("max_position_embeddings", 2048)
        if positions > MAX_POSITIONS:  # Llama 4 Scout declares 10M; the rotary tables are built for every position
            logger.warning(
                "max_position_embeddings %d is above the %d positions an artifact serves; capped to it",
                positions,
                MAX_POSITIONS,
            )
            return MAX_POSITIONS
        return positions

    def heads(self, hf: dict[str, Any], scaling: RopeScaling | None) -> dict[str, Any]:
        """The ModelConfig fields of attention's shape: num_kv_heads and head_dim (absent: hidden / heads)."""
        return {
            "num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
            "head_dim": hf.get("head_dim"),
        }

    def scales(self, hf: dict[str, Any]) -> dict[str, Any]:
        """ModelConfig's embedding, residual, attention and logits scales, where the family sets them."""
        return {}

    def layer_attention(self, hf: dict[str, Any], positions: int) -> dict[str, Any]:
        """ModelConfig's per-layer attention spans (layer_attention) and what goes with them, where the family has
        them (windows, chunks, sinks, temperature); `positions`: what the artifact serves."""
        return {}

    def moe_layers(self, hf: dict[str, Any]) -> tuple[int, ...]:
        """The decoder layers with an MoE block (the others: a dense FFN)."""
        return tuple(range(hf["num_hidden_layers"]))

    def router(self, hf: dict[str, Any]) -> RouterConfig:
        """The router kind and its settings: top k by logit, softmax over the k chosen (norm_topk_prob) or over
        all."""
        return router_config("topk_softmax", normalize=bool(hf.get("norm_topk_prob", self.default_norm_topk_prob)))

    def max_k(self, hf: dict[str, Any], num_experts: int) -> int:
        """The largest k served (requests past it are refused): every expert."""
        return num_experts

    def expert_ffn(self, hf: dict[str, Any], activation: Activation) -> FFNConfig:
        """One expert: a GLU of expert_size_key."""
        return FFNConfig("glu", hf[self.expert_size_key], activation)

    def shared_expert(self, hf: dict[str, Any], activation: Activation) -> FFNConfig | None:
        """The always-on expert beside the routed ones: a GLU of shared_expert_size_key, where it is set."""
        if self.shared_expert_size_key is None or not hf.get(self.shared_expert_size_key):
            return None
        return FFNConfig("glu", hf[self.shared_expert_size_key], activation)

    # ---- checkpoint -> the artifact's tensors ----------------------------------------------------------

    def state_dict(
        self, hf: dict[str, Any], config: ModelConfig, checkpoint: SafetensorsCheckpoint, *, progress: bool = True
    ) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors under canonical names, experts stacked; every key and shape checked (hf with
        its defaults applied, config from model_config)."""
        assert config.moe is not None
        d, n = config.hidden_size, config.moe.num_experts
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
            src, dst = layer_prefixes(i)
            norm(src + "input_layernorm", dst + "attn_norm")
            norm(src + "post_attention_layernorm", dst + "ffn_norm")
            out.update(self.attention_weights(checkpoint, hf, config, i))
            if i not in config.moe.layers:
                dense = f"{src}{self.dense_prefix}."
                out.update(glu(checkpoint, dense, dst + "ffn.", GLU_NAMES, d, config.ffn.intermediate_size))
                continue
            moe = src + self.moe_prefix + "."
            out[dst + "moe.router.weight"] = checkpoint.get(f"{moe}{self.router_name}.weight", (n, d))
            if config.moe.router.use_bias:
                out[dst + "moe.router.bias"] = checkpoint.get(f"{moe}{self.router_name}.bias", (n,))
            if getattr(config.moe.router, "correction_bias", False):  # DeepSeek-V3's selection bias
                bias = f"{moe}{self.router_name}.e_score_correction_bias"
                out[dst + "moe.router.correction_bias"] = checkpoint.get(bias, (n,))
            out.update(self.experts(checkpoint, moe, dst + "moe.experts.", n, d, config.moe.expert.intermediate_size))
            shared = config.moe.shared_expert
            if shared is not None:
                assert self.shared_expert_prefix is not None
                shared_src = f"{src}{self.shared_expert_prefix}."
                shared_dst, size = dst + "moe.shared_expert.", shared.intermediate_size
                out.update(self.shared_expert_weights(checkpoint, shared_src, shared_dst, d, size))
            if config.moe.shared_expert_gate:
                out[dst + "moe.shared_expert_gate.weight"] = checkpoint.get(moe + "shared_expert_gate.weight", (1, d))
        return out

    def attention_weights(
        self, checkpoint: SafetensorsCheckpoint, hf: dict[str, Any], config: ModelConfig, index: int
    ) -> dict[str, torch.Tensor]:
        """Layer `index`'s attention: q/k/v/o (biases as attention_bias and attention_out_bias say; q and k rows in
        the runtime's rotary order: qk_rows), the sinks, the q/k norm where the layer has one."""
        assert config.head_dim is not None and config.num_kv_heads is not None
        src, dst = layer_prefixes(index)
        d = config.hidden_size
        q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        out: dict[str, torch.Tensor] = {}
        for name, rows in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            parts = ("weight", "bias") if config.attention_bias else ("weight",)
            for part in parts:
                shape = (rows, d) if part == "weight" else (rows,)
                tensor = checkpoint.get(src + f"self_attn.{name}.{part}", shape)
                out[dst + f"attn.{name}.{part}"] = tensor if name == "v_proj" else self.qk_rows(tensor, config)
        out[dst + "attn.o_proj.weight"] = checkpoint.get(src + "self_attn.o_proj.weight", (d, q_out))
        if config.attention_out_bias:
            out[dst + "attn.o_proj.bias"] = checkpoint.get(src + "self_attn.o_proj.bias", (d,))
        if config.attention_sinks:
            out[dst + "attn.sinks"] = checkpoint.get(src + "self_attn.sinks", (config.num_heads,))
        if config.qk_norm is not None and config.attention_of(index).qk_norm:
            out.update(self.qk_norm_weights(checkpoint, config, src, dst))
        return out

    def qk_rows(self, rows: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        """A q or k projection's weight or bias, or a norm's weights over them, in the order of the runtime's
        rotary (moe_serve.exporters.hf.reorder): as stored, where the family rotates as the runtime does."""
        return rows

    def qk_norm_weights(
        self, checkpoint: SafetensorsCheckpoint, config: ModelConfig, src: str, dst: str
    ) -> dict[str, torch.Tensor]:
        """The q/k RMSNorm weights, per head or over all heads (config.qk_norm), following their rows' order."""
        assert config.head_dim is not None and config.num_kv_heads is not None
        q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        q_dim, k_dim = (config.head_dim, config.head_dim) if config.qk_norm == "per_head" else (q_out, kv_out)
        return {
            dst + "attn.q_norm.weight": self.qk_rows(checkpoint.get(src + "self_attn.q_norm.weight", (q_dim,)), config),
            dst + "attn.k_norm.weight": self.qk_rows(checkpoint.get(src + "self_attn.k_norm.weight", (k_dim,)), config),
        }

    def experts(
        self, checkpoint: SafetensorsCheckpoint, moe: str, dst: str, n: int, d: int, i: int
    ) -> dict[str, torch.Tensor]:
        """The n experts under `moe` (the layer's moe_prefix) as [n, out, in] banks gate_proj, up_proj, down_proj:
        saved one module per expert (expert_names), or in transformers 5's fused in-memory layout."""
        src = moe + "experts."
        if src + "gate_up_proj" in checkpoint:  # transformers 5's fused in-memory layout, if saved as such
            gate_up = checkpoint.get(src + "gate_up_proj", (n, 2 * i, d))
            return {
                dst + "gate_proj.weight": gate_up[:, :i].contiguous(),
                dst + "up_proj.weight": gate_up[:, i:].contiguous(),
                dst + "down_proj.weight": checkpoint.get(src + "down_proj", (n, d, i)),
            }
        per_expert = [glu(checkpoint, f"{src}{e}.", "", self.expert_names, d, i) for e in range(n)]
        return {f"{dst}{name}": torch.stack([p[name] for p in per_expert]) for name in per_expert[0]}

    def shared_expert_weights(
        self, checkpoint: SafetensorsCheckpoint, src: str, dst: str, d: int, i: int
    ) -> dict[str, torch.Tensor]:
        """The shared expert under `src` (its module: shared_expert_prefix), a GLU of width i."""
        return glu(checkpoint, src, dst, GLU_NAMES, d, i)


def layer_prefixes(index: int) -> tuple[str, str]:
    """Decoder layer `index`'s prefix in a checkpoint, and in an artifact."""
    return f"model.layers.{index}.", f"layers.{index}."


def glu(
    checkpoint: SafetensorsCheckpoint, src: str, dst: str, names: Mapping[str, str], d: int, i: int
) -> dict[str, torch.Tensor]:
    """One GLU's three linears under `src` (names: ours -> the checkpoint's), width i."""
    shapes = {"gate_proj": (i, d), "up_proj": (i, d), "down_proj": (d, i)}
    return {
        f"{dst}{ours}.weight": checkpoint.get(f"{src}{theirs}.weight", shapes[ours]) for ours, theirs in names.items()
    }


def decoder_sparse_step_layers(hf: dict[str, Any]) -> tuple[int, ...]:
    """Qwen's rule for the MoE layers: every decoder_sparse_step-th layer but those in mlp_only_layers."""
    step = hf.get("decoder_sparse_step", 1) or 1
    dense = set(hf.get("mlp_only_layers") or [])
    return tuple(i for i in range(hf["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


def check_sliding_window(hf: dict[str, Any], positions: int) -> None:
    """A window that covers every position served changes nothing (Phi-3.5-MoE ships one of 131,072, its whole
    context). A shorter one is served where every layer slides (Mixtral, Phi: their layer_attention) or where
    layer_types say which do (gpt-oss); Qwen's use_sliding_window, with its own rule for which layers slide
    (max_window_layers), is refused."""
    window = hf.get("sliding_window")
    if hf.get("use_sliding_window") and window is not None and window < positions:
        raise ExportError(
            f"sliding-window attention with use_sliding_window is not supported (sliding_window {window}, "
            f"shorter than the {positions} positions served; which layers slide follows max_window_layers)"
        )


def _tokenizer_adds_bos(tokenizer: Tokenizer, bos: int) -> bool:
    """Whether the source tokenizer's post-processor puts BOS in front of encoded text."""
    ids = tokenizer.encode_with_special_tokens("a")
    return bool(ids) and ids[0] == bos


# ---- the registry ------------------------------------------------------------------------------------------

# architecture name -> its family, in families() order (the order the refusal of another architecture lists)
ARCHITECTURES: dict[str, HFFamily] = {}
# a multimodal architecture -> the architecture of its text model, and the prefix of that model's tensors
TEXT_MODELS: dict[str, tuple[str, str]] = {}
Family = TypeVar("Family", bound=type[HFFamily])


def register(cls: Family) -> Family:
    """Class decorator: file the family under each of its architectures (and its text_models), refusing a name
    another family has taken."""
    for attribute in ("name", "architectures", "num_experts_keys", "expert_size_key", "moe_prefix"):
        if not hasattr(cls, attribute):
            raise TypeError(f"HF family {cls.__name__} must set {attribute}")
    if not cls.architectures:
        raise TypeError(f"HF family {cls.__name__} must name at least one architecture")
    taken = {*ARCHITECTURES, *TEXT_MODELS} & {*cls.architectures, *cls.text_models}
    if taken:
        raise ValueError(f"HF family {cls.__name__}: {', '.join(sorted(taken))} already registered")
    family = cls()
    entries = {**ARCHITECTURES, **dict.fromkeys(cls.architectures, family)}
    ARCHITECTURES.clear()  # in place: every module holding the dict sees the new family
    ARCHITECTURES.update(sorted(entries.items(), key=lambda entry: _display_order(entry[1].name)))  # stable
    for text_model, prefix in cls.text_models.items():
        TEXT_MODELS[text_model] = (cls.architectures[0], prefix)
    return cls


def _display_order(name: str) -> str:
    return name.casefold()


def families() -> tuple[HFFamily, ...]:
    """The registered families, by display name (case-insensitively)."""
    return tuple(dict.fromkeys(ARCHITECTURES.values()))


def family_names() -> tuple[str, ...]:
    """The display names of the models the importer converts: each family's, and its aliases (the models
    released in its architecture), by name case-insensitively; what the documents list."""
    return tuple(sorted((name for f in families() for name in (f.name, *f.aliases)), key=_display_order))


def family_of(hf: dict[str, Any]) -> tuple[str, HFFamily]:
    """The config's architecture (the first of its `architectures` registered) and its family."""
    names = hf.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return name, ARCHITECTURES[name]
    raise ExportError(
        f"unsupported architecture {', '.join(names) or '(none given)'}; supported: {', '.join(ARCHITECTURES)}"
    )
