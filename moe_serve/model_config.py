"""Model architecture config: frozen dataclasses validated in __post_init__, (de)serialised to config.json.

Every field is documented in docs/artifact-format.md. `from_dict` ignores (and logs) unknown keys so that
newer artifacts stay loadable by older runtimes; missing required keys and bad values raise ConfigError.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from moe_serve.config_schema import build, check_choice, check_float, check_size, to_jsonable
from moe_serve.errors import ConfigError
from moe_serve.moe_policy import KSpec
from moe_serve.router_registry import RouterConfig, router_class
from moe_serve.sampling_params import MAX_STOP_LENGTH, MAX_STOP_STRINGS

Task = Literal["causal_lm", "sequence_classification"]
PositionKind = Literal["learned", "rotary", "relative"]
NormPosition = Literal["pre", "post"]
NormKind = Literal["layernorm", "rmsnorm"]
ExpertKind = Literal["mlp", "glu", "adapter"]
Activation = Literal["relu", "gelu", "gelu_tanh", "silu", "swigluoai"]
Pooling = Literal["mean", "first", "last"]
QKNorm = Literal["per_head", "full"]
RopeType = Literal["linear", "yarn", "longrope", "llama3"]


# Upper bounds on sizes: far above any model served on one machine, and low enough that a corrupted or
# hostile config is refused before anything is allocated from it (a meta model with 1e9 layers, say).
MAX_LAYERS = 1024
MAX_HIDDEN_SIZE = 1 << 16
MAX_INTERMEDIATE_SIZE = 1 << 20
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_VOCAB_SIZE = 1 << 22
MAX_EXPERTS = 4096
MAX_POSITIONS = 1 << 20
MAX_LABELS = 1 << 16
MAX_CHAT_TEMPLATE_CHARS = 1 << 20
MAX_POSITION_TABLE_ELEMENTS = 1 << 30  # rotary or relative-position tables built at load (4 GiB in fp32)


@dataclass(frozen=True, slots=True)
class FFNConfig:
    """One feed-forward network: a dense layer's FFN, or one expert of an MoE layer.

    mlp:     act(x W1^T + b1) W2^T + b2
    glu:     (act(x Wg^T) * (x Wu^T)) Wd^T           (SwiGLU when act = silu; Mixtral / Qwen style)
    adapter: act(x Wdown^T + bdown) Wup^T (+ bup)    (bottleneck adapter, SMEAR / HyperMoE style)

    Activation swigluoai (gpt-oss, glu only) is defined on the pair: g = min(x Wg^T + bg, swiglu_limit),
    g * sigmoid(swiglu_alpha g) * (clamp(x Wu^T + bu, -swiglu_limit, swiglu_limit) + 1) (vocabulary.glu).
    """

    kind: ExpertKind
    intermediate_size: int
    activation: Activation = "silu"
    use_bias: bool = False
    swiglu_alpha: float | None = None  # swigluoai only
    swiglu_limit: float | None = None  # swigluoai only

    def __post_init__(self) -> None:
        check_choice("ffn kind", self.kind, ExpertKind)
        check_size("intermediate_size", self.intermediate_size, MAX_INTERMEDIATE_SIZE)
        check_choice("activation", self.activation, Activation)
        clamped = (self.swiglu_alpha, self.swiglu_limit)
        if self.activation == "swigluoai":
            if self.kind != "glu" or None in clamped:
                raise ConfigError("activation swigluoai needs ffn kind glu, swiglu_alpha and swiglu_limit")
            check_float("swiglu_alpha", self.swiglu_alpha, 0.0, 1e6, low_open=True)  # type: ignore[arg-type]
            check_float("swiglu_limit", self.swiglu_limit, 0.0, 1e6, low_open=True)  # type: ignore[arg-type]
        elif clamped != (None, None):
            raise ConfigError(f"swiglu_alpha and swiglu_limit go with activation swigluoai; got {self.activation}")


@dataclass(frozen=True, slots=True)
class ExpertsPerToken:
    """The k a request may choose: `default` when it names none, and the allowed range."""

    default: int
    min: int = 1
    max: int | None = None  # None: num_experts
    # The k this model was trained or validated at (docs/architecture.md §3): any other allowed k is served but
    # flagged approximate. None: every k (imports, and kinds whose own rule says which k are exact).
    validated: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("default", "min"):
            check_size(f"experts_per_token.{name}", getattr(self, name), MAX_EXPERTS)
        if self.max is not None:
            check_size("experts_per_token.max", self.max, MAX_EXPERTS)
        if self.validated is not None:
            if not self.validated or len(self.validated) > MAX_EXPERTS:
                raise ConfigError(f"experts_per_token.validated must list 1..{MAX_EXPERTS} k; got {self.validated}")
            for k in self.validated:
                check_size("experts_per_token.validated[]", k, MAX_EXPERTS)


@dataclass(frozen=True, slots=True)
class MoEConfig:
    num_experts: int
    layers: tuple[int, ...]
    expert: FFNConfig
    router: RouterConfig
    experts_per_token: ExpertsPerToken
    shared_expert: FFNConfig | None = None
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(x w) scales the shared expert
    # HyperMoE (router kind hyper_expert): the adapter added, ungated, to every token's routed output; one
    # per selected set of the trained k (C(N, k) of them, in routers.hyper_expert.selected_sets order).
    hyper_expert: FFNConfig | None = None
    # Llama 4: each chosen expert runs on the token times its routing weight, and the experts' outputs are
    # summed unweighted (else: each output times its weight). The same for linear experts, not for others.
    weights_scale_input: bool = False

    def __post_init__(self) -> None:
        check_size("moe.num_experts", self.num_experts, MAX_EXPERTS)
        k = self.experts_per_token
        k_max = k.max if k.max is not None else self.num_experts
        if not 1 <= k.min <= k.default <= k_max <= self.num_experts:
            raise ConfigError(
                f"experts_per_token range must satisfy 1 <= min <= default <= max <= num_experts "
                f"({self.num_experts}); got min={k.min}, default={k.default}, max={k_max}"
            )
        if k.validated is not None and not all(k.min <= v <= k_max for v in k.validated):
            raise ConfigError(
                f"experts_per_token.validated must lie in the allowed range {k.min}..{k_max}; got {list(k.validated)}"
            )
        if self.shared_expert_gate and self.shared_expert is None:
            raise ConfigError("moe.shared_expert_gate needs moe.shared_expert")
        if self.weights_scale_input and router_class(self.router.kind).per_sequence:
            raise ConfigError(f"moe.weights_scale_input is not defined for router kind {self.router.kind}")
        router_class(self.router.kind).check_moe(self)

    @property
    def num_patterns(self) -> int:
        """HyperMoE: the selected sets of the trained k, each with its adapter."""
        return math.comb(self.num_experts, self.default_k)

    @property
    def min_k(self) -> int:
        return self.experts_per_token.min

    @property
    def max_k(self) -> int:
        k = self.experts_per_token.max
        return k if k is not None else self.num_experts

    @property
    def default_k(self) -> int:
        return self.experts_per_token.default

    def is_approximate(self, k: int) -> bool:
        """Whether k is one the router kind does not define exactly (soft_merge below N, say), or one this
        model was never validated at (experts_per_token.validated)."""
        validated = self.experts_per_token.validated
        return (validated is not None and k not in validated) or router_class(self.router.kind).is_approximate(
            k, self.num_experts, self.experts_per_token.default
        )

    def exact_ks(self) -> tuple[int, ...]:
        """The allowed k that are not approximate: the k the model trained or was validated at."""
        return tuple(k for k in range(self.min_k, self.max_k + 1) if not self.is_approximate(k))


@dataclass(frozen=True, slots=True)
class ClassifierConfig:
    labels: tuple[str, ...]
    pooling: Pooling = "mean"
    pooler_dense: bool = False  # BERT-style dense + tanh before the classification head

    def __post_init__(self) -> None:
        if not 2 <= len(self.labels) <= MAX_LABELS:
            raise ConfigError(f"classifier.labels needs 2 to {MAX_LABELS} labels; got {len(self.labels)}")
        if not all(isinstance(label, str) and label for label in self.labels):
            raise ConfigError(f"classifier.labels must be non-empty strings; got {list(self.labels)[:8]}")
        if len(set(self.labels)) != len(self.labels):
            raise ConfigError(f"classifier.labels must be distinct; got {list(self.labels)[:8]}")
        check_choice("classifier.pooling", self.pooling, Pooling)


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary scaling as Hugging Face defines it: `linear` divides the frequencies by `factor`; `yarn`
    blends interpolated and extrapolated frequencies and scales cos/sin by an attention factor; `longrope`
    (Phi-3.5-MoE) divides each frequency by its own `short_factor` and scales cos/sin by `attention_factor`
    (the source's short_mscale). Only longrope's short regime is served: it is what transformers computes
    for a position below original_max_position_embeddings, whereas past it transformers switches scale by
    the length of the whole call (not per position), which a paged KV cache cannot follow; ModelConfig
    therefore keeps max_position_embeddings within original_max_position_embeddings."""

    type: RopeType
    factor: float  # linear, yarn; longrope: the context extension the source declares (not used to serve)
    original_max_position_embeddings: int | None = None  # yarn, longrope
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None  # longrope: one divisor per frequency (head_dim / 2)
    # llama3 (Llama 3.1, Llama 4): wavelengths above original / low_freq_factor are divided by `factor`, those
    # below original / high_freq_factor kept, those between interpolated
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None

    def __post_init__(self) -> None:
        check_choice("rope_scaling.type", self.type, RopeType)
        check_float("rope_scaling.factor", self.factor, 0.0, 1e6, low_open=True)
        if self.type == "llama3":
            if self.low_freq_factor is None or self.high_freq_factor is None:
                raise ConfigError("rope_scaling of type llama3 needs low_freq_factor and high_freq_factor")
            if not 0 < self.low_freq_factor <= self.high_freq_factor:  # equal: no band between (Llama 4 Scout)
                raise ConfigError(
                    "rope_scaling llama3 needs 0 < low_freq_factor <= high_freq_factor; got "
                    f"{self.low_freq_factor}, {self.high_freq_factor}"
                )
        elif (self.low_freq_factor, self.high_freq_factor) != (None, None):
            raise ConfigError(f"rope_scaling low/high_freq_factor go with type llama3 only; got type {self.type}")
        if self.type in ("yarn", "longrope", "llama3") and self.original_max_position_embeddings is None:
            raise ConfigError(f"rope_scaling of type {self.type} needs original_max_position_embeddings")
        if self.type == "longrope":
            if self.short_factor is None or self.attention_factor is None:
                raise ConfigError("rope_scaling of type longrope needs short_factor and attention_factor")
            for value in self.short_factor:
                check_float("rope_scaling.short_factor[]", value, 0.0, 1e6, low_open=True)
        elif self.short_factor is not None:
            raise ConfigError(f"rope_scaling.short_factor goes with type longrope only; got type {self.type}")
        if self.original_max_position_embeddings is not None:
            check_size(
                "rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings, MAX_POSITIONS
            )
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(self, name) is not None:
                check_float(f"rope_scaling.{name}", getattr(self, name), 0.0, 1e6, low_open=True)


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """How one layer's attention differs from causal attention over every earlier position, for models whose
    layers differ (gpt-oss alternates sliding-window and full layers; Llama 4 has local-chunk layers and
    global layers without rotary). Served on the paged cache by ops.attention's window and chunk."""

    window: int | None = None  # each query sees its last `window` keys, itself included
    chunk: int | None = None  # each query sees the keys of its own chunk of `chunk` positions
    rotary: bool = True  # False: q and k of this layer get no rotary embedding (NoPE)
    qk_norm: bool = True  # False: this layer skips the model's q/k norm (Llama 4's NoPE layers)

    def __post_init__(self) -> None:
        for name in ("window", "chunk"):
            if getattr(self, name) is not None:
                check_size(f"layer_attention[].{name}", getattr(self, name), MAX_POSITIONS)

    @property
    def reach(self) -> int | None:
        """The most keys back a query of this layer reads, itself included (a window, or its local chunk);
        None: every earlier key. Blocks of keys wholly before that are never read again (engine.kv_cache)."""
        spans = [n for n in (self.window, self.chunk) if n is not None]
        return min(spans) if spans else None


PLAIN_ATTENTION = LayerAttention()


@dataclass(frozen=True, slots=True)
class AttentionTemperature:
    """Llama 4's temperature tuning on its layers without rotary (arXiv 2501.19399): the query at position p is
    multiplied by log(floor((p + 1) / floor_scale) + 1) * scale + 1, so attention sharpens with distance."""

    floor_scale: float
    scale: float

    def __post_init__(self) -> None:
        check_float("attention_temperature.floor_scale", self.floor_scale, 0.0, 1e12, low_open=True)
        check_float("attention_temperature.scale", self.scale, 0.0, 1e6)


@dataclass(frozen=True, slots=True)
class LatentAttentionConfig:
    """Multi-head latent attention (MLA; DeepSeek-V2/V3), in place of the q/k/v projections. Per token:

        q       = x Wq (or RMSNorm(x Wqa) Wqb, with q_lora_rank)     [H, nope + rope]
        c, k_pe = split(x Wkva)                                      [kv_lora_rank], [rope] (one for all heads)
        c       = RMSNorm(c)                                         the latent the cache keeps, with rotated k_pe
        k_h     = [c Wuk_h, k_pe], v_h = c Wuv_h                     (Wkvb holds Wuk_h and Wuv_h per head)

    and rotary on the rope part of q and k only; ModelConfig.head_dim is that rope part (the position tables'
    size). The softmax scale is ModelConfig.attention_scale, by default (nope + rope)^-0.5. Served in the
    absorbed form (moe_serve/layers/latent_attention.py): the cache holds c and k_pe per token, not K and V."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: q projected from the hidden state directly (DeepSeek-V2-Lite)
    # The q_a / kv_a RMSNorms' epsilon: DeepSeek builds them with its default 1e-6 whatever rms_norm_eps says.
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check_size(f"latent_attention.{name}", getattr(self, name), MAX_INTERMEDIATE_SIZE)
        if self.q_lora_rank is not None:
            check_size("latent_attention.q_lora_rank", self.q_lora_rank, MAX_INTERMEDIATE_SIZE)
        check_float("latent_attention.norm_eps", self.norm_eps, 0.0, 1.0, low_open=True)

    @property
    def cache_width(self) -> int:
        """Values the cache keeps per token per layer: the latent and the rotated shared key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def full_kv_width(self, num_heads: int) -> int:
        """Values per token per layer that caching each head's keys and values would take instead."""
        return num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The whole network. Derived sizes (head_dim, num_kv_heads) are completed in __post_init__."""

    task: Task
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn: FFNConfig  # the FFN of every layer not listed in moe.layers
    moe: MoEConfig | None = None
    num_kv_heads: int | None = None  # grouped-query attention; None: num_heads
    head_dim: int | None = None  # None: hidden_size // num_heads
    attention_bias: bool = False  # biases on q, k, v (output projection: attention_out_bias)
    attention_out_bias: bool = False
    position: PositionKind = "rotary"
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Partial rotary (GLM-4.5's partial_rotary_factor): the pairs (j, j + head_dim/2) for j < rotary_dim/2 rotate
    # as a rotary_dim-wide rotation would, the others pass through (an import reorders each head's q/k rows to
    # put the source's rotated dims there). None: head_dim, every pair.
    rotary_dim: int | None = None
    qk_norm: QKNorm | None = None  # RMSNorm on q and k: per head (Qwen3-MoE) or over all heads (OLMoE)
    qkv_clip: float | None = None  # clamp q, k, v to [-clip, clip] (OLMoE's clip_qkv)
    norm: NormKind = "rmsnorm"
    norm_eps: float = 1e-5
    norm_position: NormPosition = "pre"
    final_norm: bool = True  # a norm after the last layer (pre-norm models)
    # Token embeddings are multiplied by it: sqrt(d_model) in Transformer-XL, embedding_multiplier in Granite.
    embedding_scale: float = 1.0
    # Each layer's attention and FFN outputs are multiplied by it before they join the residual stream
    # (Granite's residual_multiplier).
    residual_scale: float = 1.0
    attention_scale: float | None = None  # the attention's softmax scale; None: 1/sqrt(head_dim) (Granite: its own)
    logits_divisor: float = 1.0  # the LM head's logits are divided by it (Granite's logits_scaling)
    # One entry per layer when layers attend differently (windows, local chunks, NoPE); None: all plain.
    layer_attention: tuple[LayerAttention, ...] | None = None
    attention_sinks: bool = False  # per layer, a learned logit per query head in the softmax's denominator
    attention_temperature: AttentionTemperature | None = None  # on the layers without rotary (layer_attention)
    latent_attention: LatentAttentionConfig | None = None  # MLA in every layer (DeepSeek-V2/V3); None: q/k/v
    tie_word_embeddings: bool = False
    lm_head_bias: bool = False
    classifier: ClassifierConfig | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None  # one id, or several that all end generation
    add_bos_token: bool = False  # text inputs start with bos_token_id
    chat_template: str | None = None
    # Stop strings a chat request gets when it sets no `stop` of its own: how a reply ends for a model
    # without an EOS token (the bundled play-dialogue LMs end a speech at a blank line).
    chat_stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_choice("task", self.task, Task)
        for name, maximum in (
            ("vocab_size", MAX_VOCAB_SIZE),
            ("hidden_size", MAX_HIDDEN_SIZE),
            ("num_layers", MAX_LAYERS),
            ("num_heads", MAX_HEADS),
            ("max_position_embeddings", MAX_POSITIONS),
        ):
            check_size(name, getattr(self, name), maximum)
        check_float("norm_eps", self.norm_eps, 0.0, 1.0, low_open=True)
        check_float("rope_theta", self.rope_theta, 0.0, 1e12, low_open=True)
        for name in ("embedding_scale", "residual_scale", "logits_divisor"):
            check_float(name, getattr(self, name), 0.0, 1e6, low_open=True)
        if self.attention_scale is not None:
            check_float("attention_scale", self.attention_scale, 0.0, 1e6, low_open=True)
        if self.qkv_clip is not None:
            check_float("qkv_clip", self.qkv_clip, 0.0, 1e6, low_open=True)
        check_choice("position", self.position, PositionKind)
        check_choice("norm", self.norm, NormKind)
        check_choice("norm_position", self.norm_position, NormPosition)
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ConfigError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_heads ({self.num_heads}); "
                    "set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        head_dim, num_kv_heads = self.head_dim, self.num_kv_heads
        assert head_dim is not None and num_kv_heads is not None  # completed just above
        check_size("head_dim", head_dim, MAX_HEAD_DIM)
        check_size("num_kv_heads", num_kv_heads, MAX_HEADS)
        if self.num_heads % num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.qk_norm is not None:
            check_choice("qk_norm", self.qk_norm, QKNorm)
        if self.rope_scaling is not None and self.position != "rotary":
            raise ConfigError("rope_scaling needs position rotary")
        self._check_layer_attention()
        self._check_latent_attention(head_dim)
        if self.rope_scaling is not None and self.rope_scaling.type == "longrope":
            self._check_longrope(self.rope_scaling, head_dim)
        if self.position == "rotary" and head_dim % 2:
            raise ConfigError(f"rotary positions need an even head_dim; got {self.head_dim}")
        if self.rotary_dim is not None and self.latent_attention is not None:
            raise ConfigError("rotary_dim (partial rotary) is not defined with latent_attention")
        if self.rotary_dim is not None and (
            self.position != "rotary" or self.rotary_dim % 2 or not 2 <= self.rotary_dim <= head_dim
        ):
            raise ConfigError(
                f"rotary_dim must be even, 2 to head_dim ({head_dim}), with rotary positions; got {self.rotary_dim}"
            )
        if self.moe is not None:
            bad = [i for i in self.moe.layers if not (isinstance(i, int) and 0 <= i < self.num_layers)]
            if bad or len(set(self.moe.layers)) != len(self.moe.layers):
                raise ConfigError(
                    f"moe.layers must be distinct layer indices in 0..{self.num_layers - 1}; got "
                    f"{list(self.moe.layers)}"
                )
            router_class(self.moe.router.kind).check_model(self)
        if self.task == "sequence_classification":
            if self.classifier is None:
                raise ConfigError("task sequence_classification needs a classifier section with labels")
        elif self.classifier is not None:
            raise ConfigError("classifier is only valid for task sequence_classification")
        if self.add_bos_token and self.bos_token_id is None:
            raise ConfigError("add_bos_token needs bos_token_id")
        for name, tokens in (("bos_token_id", [self.bos_token_id]), ("eos_token_id", self.eos_token_ids)):
            for token in tokens:
                if token is not None and not (isinstance(token, int) and 0 <= token < self.vocab_size):
                    raise ConfigError(f"{name} {token} is outside the vocabulary (size {self.vocab_size})")
        if self.chat_template is not None and len(self.chat_template) > MAX_CHAT_TEMPLATE_CHARS:
            raise ConfigError(f"chat_template is longer than {MAX_CHAT_TEMPLATE_CHARS} characters")
        if self.chat_stop and self.chat_template is None:
            raise ConfigError("chat_stop needs chat_template (it applies to chat requests only)")
        if len(self.chat_stop) > MAX_STOP_STRINGS or not all(0 < len(s) <= MAX_STOP_LENGTH for s in self.chat_stop):
            raise ConfigError(
                f"chat_stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_LENGTH} "
                f"characters; got {list(self.chat_stop)[:4]!r}"
            )
        if self.position_table_elements > MAX_POSITION_TABLE_ELEMENTS:
            raise ConfigError(
                f"the {self.position} position tables for max_position_embeddings {self.max_position_embeddings} "
                f"would hold {self.position_table_elements:,} values (the limit is {MAX_POSITION_TABLE_ELEMENTS:,})"
            )

    def _check_layer_attention(self) -> None:
        moe = self.moe
        if moe is not None and router_class(moe.router.kind).reads_attention and self.attention_features:
            raise ConfigError(
                f"router kind {moe.router.kind} reads plain attention; this model has "
                f"{', '.join(self.attention_features)}"
            )
        spans = self.layer_attention
        if spans is None:
            if self.attention_temperature is not None:
                raise ConfigError("attention_temperature applies to layers without rotary; layer_attention has none")
            return
        if len(spans) != self.num_layers:
            raise ConfigError(f"layer_attention needs one entry per layer ({self.num_layers}); got {len(spans)}")
        if not self.is_causal and any(a.window is not None or a.chunk is not None for a in spans):
            raise ConfigError("layer_attention: sliding windows and local chunks need a causal model")
        if self.position != "rotary" and any(not a.rotary for a in spans):
            raise ConfigError(f"layer_attention: rotary false needs position rotary; got position {self.position}")
        if self.attention_temperature is not None and all(a.rotary for a in spans):
            raise ConfigError("attention_temperature applies to layers without rotary; layer_attention has none")

    @property
    def attention_features(self) -> tuple[str, ...]:
        """This model's attention features beyond plain attention over every earlier position, named as the
        paths that do not serve them refuse it (the decode stack, CUDA graphs, the ONNX export, vLLM)."""
        spans = self.layer_attention or ()
        found = {
            "sliding-window attention": any(a.window is not None for a in spans),
            "local attention chunks": any(a.chunk is not None for a in spans),
            "layers without rotary (NoPE)": any(not a.rotary for a in spans),
            "layers without the q/k norm": self.qk_norm is not None and any(not a.qk_norm for a in spans),
            "attention temperature tuning": self.attention_temperature is not None,
            "attention sinks": self.attention_sinks,
            "multi-head latent attention": self.latent_attention is not None,
        }
        return tuple(name for name, used in found.items() if used)

    def attention_of(self, index: int) -> LayerAttention:
        """Layer `index`'s attention span and positions."""
        return self.layer_attention[index] if self.layer_attention is not None else PLAIN_ATTENTION

    def _check_latent_attention(self, head_dim: int) -> None:
        mla = self.latent_attention
        if mla is None:
            return
        if not self.is_causal or self.position != "rotary":
            raise ConfigError("latent_attention serves causal LMs with rotary positions")
        if head_dim != mla.qk_rope_head_dim:
            raise ConfigError(
                f"with latent_attention, head_dim is the rotary part of each head, qk_rope_head_dim "
                f"({mla.qk_rope_head_dim}); got {head_dim}"
            )
        others = {
            "qk_norm": self.qk_norm is not None,
            "qkv_clip": self.qkv_clip is not None,
            "attention_sinks": self.attention_sinks,
            "layer_attention": self.layer_attention is not None,
        }
        if any(others.values()):
            raise ConfigError(
                f"latent_attention does not combine with {', '.join(name for name, on in others.items() if on)}"
            )

    def _check_longrope(self, scaling: RopeScaling, head_dim: int) -> None:
        assert scaling.short_factor is not None and scaling.original_max_position_embeddings is not None
        if len(scaling.short_factor) != head_dim // 2:
            raise ConfigError(
                f"rope_scaling.short_factor needs head_dim / 2 = {head_dim // 2} values; "
                f"got {len(scaling.short_factor)}"
            )
        if self.max_position_embeddings > scaling.original_max_position_embeddings:
            raise ConfigError(
                "rope_scaling longrope is served in its short regime only, for positions below "
                f"original_max_position_embeddings ({scaling.original_max_position_embeddings}); "
                f"max_position_embeddings {self.max_position_embeddings} goes past it"
            )

    @property
    def position_table_elements(self) -> int:
        """Values in the position tables built at load (rotary cos/sin, or relative-position keys)."""
        positions = self.max_position_embeddings
        if self.position == "rotary":
            return positions * self.head_dim  # type: ignore[operator]  # completed above
        if self.position == "relative":
            distances = positions if self.is_causal else 2 * positions - 1
            return 2 * distances * self.hidden_size  # the sinusoids and their projection
        return 0

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    @property
    def is_causal(self) -> bool:
        return self.task == "causal_lm"

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and index in self.moe.layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The MoE layers in model order (the order of per-layer expert counts); () for a dense model."""
        return tuple(sorted(self.moe.layers)) if self.moe is not None else ()

    def reported_k(self, k: int | KSpec) -> int | None:
        """The k a result reports: None for a model without MoE layers, where k means nothing, for a top-p
        policy, whose tokens each took their own k, and for "auto", whose steps each ran at their own k
        (both reported as a mean, ExpertCounts)."""
        spec = KSpec.of(k)
        return spec.k if self.moe is not None and not spec.k_varies else None

    def is_approximate(self, k: int | KSpec) -> bool:
        """Whether results at k are an approximation of the trained method (flagged in responses); under
        a top-p policy or "auto" as requested, whether any k its tokens may take is."""
        spec = KSpec.of(k)
        return self.moe is not None and any(self.moe.is_approximate(n) for n in range(spec.lowest, spec.k + 1))

    @classmethod
    def from_dict(cls, data: Any) -> ModelConfig:
        """Parsed JSON (anything: a non-object is one ConfigError) -> the config."""
        return build(cls, data, "model")

    def to_dict(self) -> dict[str, Any]:
        return to_jsonable(dataclasses.asdict(self))


__all__ = [
    "ClassifierConfig",
    "ExpertsPerToken",
    "FFNConfig",
    "LatentAttentionConfig",
    "ModelConfig",
    "MoEConfig",
    "RopeScaling",
]
