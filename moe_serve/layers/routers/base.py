"""The router-kind interface and its registry (docs/architecture.md §3).

A router kind is one module with one `Router` subclass, registered by name, that owns everything about the
kind:
- its settings: `Router.Config`, a frozen dataclass extending RouterConfig, whose fields sit flat in
  config.json's `moe.router` and are checked by its own `__post_init__`;
- its weighting: `Router.weighting`, data (ops.Weighting) that the kernels consume;
- its model-level checks (`check_moe`, `check_model`), whether the ONNX graph can express it
  (`onnx_refusal`), which k it defines exactly (`is_approximate`);
- its slow reference (`reference_weights`, `reference_scores`), which the tests compare the fast path with.

route(logits [R, N] fp32, token_k [R], max_k, state) -> (topk_ids [R, K], topk_weights [R, K]):
R rows (tokens, or sequences for a per-sequence kind), N experts, K = max_k slots; slots beyond a row's
own k get id -1 and weight 0 and are never computed. Ties go to the lower expert index; no noise, no
capacity limit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from moe_serve.config_schema import check_choice
from moe_serve.errors import ConfigError
from moe_serve.kernels import ops
from moe_serve.kernels.ops import Weighting
from moe_serve.layers.norm import NormKind

if TYPE_CHECKING:
    from moe_serve.kernels.ops import AttentionBatch
    from moe_serve.layers.attention import AttentionInputs
    from moe_serve.model_config import ModelConfig, MoEConfig

_REGISTRY: dict[str, type[Router]] = {}

# Every format-1 artifact wrote one flat router object with every kind's settings at their defaults (a
# topk_softmax router carried tau, sigma, heads, ...). A kind reads its own; these are dropped silently.
FLAT_ROUTER_KEYS = ("normalize", "use_bias", "input_norm", "tau", "sigma", "heads")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """What every router kind has: its name and whether the router linear has a bias. A kind's own
    settings extend this class (`Router.Config`); `router_config(kind, **settings)` builds one."""

    kind: str
    use_bias: bool = False  # the router linear's bias (HyperRouter's folded b_r, say)

    def __post_init__(self) -> None:
        cls = _REGISTRY.get(self.kind)
        if cls is None:
            raise ConfigError(f"router kind must be one of {', '.join(router_kinds())}; got {self.kind!r}")
        if not isinstance(self, cls.Config):
            raise ConfigError(f"router kind {self.kind} takes its settings as {cls.Config.__name__}")

    def describe(self) -> str:
        """The kind, and any setting a reader of a model summary should see."""
        return self.kind

    @classmethod
    def config_variant(cls, data: Any, where: str) -> tuple[type, Any]:
        """config_schema.build's hook: the kind's own config class for a parsed `moe.router` object, and
        the object without the format-1 keys of other kinds."""
        if not isinstance(data, dict):
            return cls, data  # build refuses it: "must be an object"
        kind = data.get("kind")
        if not isinstance(kind, str) or kind not in _REGISTRY:
            raise ConfigError(f"router kind must be one of {', '.join(router_kinds())}; got {kind!r} ({where}.kind)")
        config_cls = _REGISTRY[kind].Config
        own = {f.name for f in dataclasses.fields(config_cls)}
        return config_cls, {key: value for key, value in data.items() if key in own or key not in FLAT_ROUTER_KEYS}


@dataclass(frozen=True, slots=True)
class PooledRouterConfig(RouterConfig):
    """The settings of a per-sequence kind (Router.per_sequence): it routes the masked mean of the input's
    MoE-layer inputs, normed first when input_norm is set (SMEAR's LN_in)."""

    input_norm: NormKind | None = None

    def __post_init__(self) -> None:
        RouterConfig.__post_init__(self)
        if self.input_norm is not None:
            check_choice("router input_norm", self.input_norm, NormKind)


def router_config(kind: str, **settings: Any) -> RouterConfig:
    """The config of router kind `kind` with its settings (ConfigError for an unknown kind or setting)."""
    if kind not in _REGISTRY:
        raise ConfigError(f"router kind must be one of {', '.join(router_kinds())}; got {kind!r}")
    config_cls = _REGISTRY[kind].Config
    unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(config_cls)})
    if unknown:
        raise ConfigError(f"router kind {kind} has no setting {', '.join(unknown)}")
    return config_cls(kind=kind, **settings)


def register(kind: str) -> Callable[[type[Router]], type[Router]]:
    def add(cls: type[Router]) -> type[Router]:
        if kind in _REGISTRY and _REGISTRY[kind] is not cls:
            raise ValueError(f"router kind {kind!r} is already registered ({_REGISTRY[kind].__module__})")
        cls.kind = kind
        _REGISTRY[kind] = cls
        return cls

    return add


def unregister(kind: str) -> None:
    """Forget a kind (tests that register a throwaway kind)."""
    _REGISTRY.pop(kind, None)


def router_kinds() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def router_class(kind: str) -> type[Router]:
    return _REGISTRY[kind]


@dataclass(frozen=True, slots=True)
class RouterState:
    """What a stateful router reads besides the logits: the step's tokens (their MoE-layer inputs and where
    each sits in its sequence) and its per-token memory in one MoE layer. Row `slot` of `cache` belongs to
    the token the KV cache keeps at that slot, so the state follows chunked prefill, prefix caching and
    preemption. Without a cache (classify, whole sequences), every sequence is whole in the step."""

    cache: torch.Tensor | None  # [NB * BS, state_size] fp32
    batch: AttentionBatch  # the step's tokens: sequences, positions, block tables, slot mapping
    block_size: int
    inputs: torch.Tensor  # [T, D] the MoE layer's input of each token of the step
    attention: AttentionInputs | None = None  # the same layer's attention (kinds with reads_attention)
    moe_layer: int = 0  # this block's position in moe.layers (per-layer router settings are in that order)

    def rows_of(self, seq: int, num_tokens: int) -> torch.Tensor:
        """The state rows of a sequence's first num_tokens tokens, in order: [num_tokens] int64."""
        assert self.cache is not None and self.batch.block_tables is not None
        positions = torch.arange(num_tokens, device=self.cache.device)
        table = self.batch.block_tables[seq].long()
        return table[positions // self.block_size] * self.block_size + positions % self.block_size


class Router:
    kind: ClassVar[str] = ""
    Config: ClassVar[type[RouterConfig]] = RouterConfig  # the kind's settings
    weighting: Weighting = (
        Weighting.SOFTMAX_CHOSEN
    )  # how the chosen experts are weighted (a kind may set it per config)
    per_sequence: ClassVar[bool] = False  # one decision per whole input: the MoE block routes its pooled mean
    # per_sequence kinds: merge the chosen experts' parameters into one expert (SMEAR), or apply each.
    merges_experts: ClassVar[bool] = False
    # Whether a top-p policy (moe_serve.moe_policy) is defined for the kind: it picks each token's experts
    # by the full softmax of its own router logits, largest first, so "experts in order of router
    # probability" is its own order. Off unless a kind says so: requests with a policy are then refused.
    top_p_defined: ClassVar[bool] = False
    # Whether the kind reads the same layer's attention (its queries, keys, values, scores): RouterState.attention.
    reads_attention: ClassVar[bool] = False
    # Whether the ONNX export may trace the kind's route: it reads only its logits, in plain torch ops (the
    # export then proves the graph against the model on fresh shapes). Off unless a kind says so.
    onnx_graph: ClassVar[bool] = False

    def __init__(self, config: RouterConfig, num_experts: int) -> None:
        self.config = config
        self.num_experts = num_experts

    # ---- serving ------------------------------------------------------------------------------------

    def route(
        self, logits: torch.Tensor, token_k: torch.Tensor, max_k: int, state: RouterState | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> topk_ids [R, K] (-1 beyond a row's k), topk_weights [R, K] fp32. By default the top-k logits,
        weighted by the kind's weighting; a kind that reads more than the logits overrides this."""
        return ops.topk_route(logits, token_k, max_k, self.weighting)

    @classmethod
    def tensor_shapes(cls, config: RouterConfig, num_experts: int) -> dict[str, tuple[int, ...]]:
        """The kind's own tensors per MoE layer besides the router linear, name -> shape (DeepSeek-V3's
        correction bias, say). The MoE block holds them on the router linear, so an artifact stores them as
        `moe.router.<name>`, in fp32 as router weights are, and hands them to `bind` once loaded. {}: none."""
        return {}

    def bind(self, tensors: dict[str, torch.Tensor]) -> None:
        """Receive the tensors of `tensor_shapes` (fp32), from MoEBlock.prepare after loading."""

    @classmethod
    def max_k_reason(cls, moe: MoEConfig) -> str | None:
        """Why no k above the model's experts_per_token.max can be served, when the kind's own rule sets that
        bound (a request past it is refused with this reason); None: the model's range alone."""
        return None

    @classmethod
    def state_size(cls, num_experts: int, hidden_size: int) -> int:
        """Floats the kind keeps per token in the paged cache for the later tokens of the sequence (0: none)."""
        return 0

    @classmethod
    def is_approximate(cls, k: int, num_experts: int, trained_k: int) -> bool:
        """Whether k is outside what the method defines exactly (flagged in responses); trained_k: the
        model's default k, the one it was trained at."""
        return False

    # ---- checks -------------------------------------------------------------------------------------

    @classmethod
    def check_moe(cls, moe: MoEConfig) -> None:
        """Refuse (ConfigError) an MoE section this kind cannot serve. By default: no HyperMoE adapters,
        which only the hyper_expert kind reads."""
        if moe.hyper_expert is not None:
            raise ConfigError("moe.hyper_expert (the HyperMoE adapters) goes with router kind hyper_expert, and only")

    @classmethod
    def check_model(cls, config: ModelConfig) -> None:
        """Refuse (ConfigError) a model this kind cannot serve."""
        if cls.per_sequence and config.task != "sequence_classification":
            raise ConfigError(
                f"router kind {cls.kind} decides once per complete input, so it is served for task "
                f"sequence_classification only; this config has task {config.task}"
            )

    @classmethod
    def onnx_refusal(cls, config: ModelConfig) -> str | None:
        """Why the ONNX graph cannot express this kind (None: it can). The export traces the model's own
        layers, so a kind that reads only its logits exports as it is served; one that keeps per-token
        state in the cache cannot, as the graph carries only keys and values between runs."""
        assert config.moe is not None
        if cls.state_size(config.moe.num_experts, config.hidden_size) > 0:
            return (
                f"router kind '{cls.kind}' keeps per-token routing state in the KV cache (graph-of-tokens routing: "
                "each token's choice mixes over earlier tokens of its sequence); the ONNX graph carries only keys "
                "and values between runs, so it cannot express this router"
            )
        if not cls.onnx_graph:
            graphed = [kind for kind in router_kinds() if _REGISTRY[kind].onnx_graph]
            return f"router kind '{cls.kind}' has no ONNX graph; export-onnx expresses {', '.join(graphed)}"
        return None

    # ---- the slow reference the tests compare with ------------------------------------------------

    def reference_scores(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor | None:
        """One whole sequence, float64: x [n, D] its MoE-layer inputs, logits [n, N] -> the scores each token's
        top-k is taken from, if not its logits (then weighted as q[e] / sum of the chosen q); None: route by
        the logits and the weighting."""
        return None

    def reference_weights(self, logits: list[float], chosen: list[int]) -> list[float]:
        """The combine weights of the chosen experts (largest logit first), one token at a time in plain
        Python: the weighting written out, independent of the kernels."""
        if self.weighting is Weighting.UNIFORM:
            return [1.0 / len(chosen)] * len(chosen)
        peak = max(logits)
        pool = range(len(logits)) if self.weighting is Weighting.SOFTMAX_ALL else chosen
        z = sum(math.exp(logits[i] - peak) for i in pool)
        return [math.exp(logits[i] - peak) / z for i in chosen]
