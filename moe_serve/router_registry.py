"""The router-kind registry and what the configs ask of a kind, without torch (docs/architecture.md §3).

A router kind is one module in moe_serve/layers/routers/ with one `Router` subclass registered by name (the
`kind` of config.json's `moe.router`). This module holds what sits below the model's config: the settings
every kind has (`RouterConfig`, which a kind's own `Config` extends), the registry (`register`,
`router_class`, `router_config`), and `RouterKind`, the rules a config and the engine read from a kind
(`check_moe`, `check_model`, `state_size`, ...). `Router` (layers/routers/base.py) adds the routing itself.

Kinds register when their module is imported: `moe_serve.layers.routers` imports every built-in kind, and
whatever parses an artifact's config imports it first (moe_serve.artifact, moe_serve.onnx_model, the vLLM
plugin), so that the config below it never imports the layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from moe_serve.errors import ConfigError

_REGISTRY: dict[str, type[RouterKind]] = {}

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
            raise ConfigError(f"router kind must be one of {_known()}; got {self.kind!r}")
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
            raise ConfigError(f"router kind must be one of {_known()}; got {kind!r} ({where}.kind)")
        config_cls = _REGISTRY[kind].Config
        own = {f.name for f in dataclasses.fields(config_cls)}
        return config_cls, {key: value for key, value in data.items() if key in own or key not in FLAT_ROUTER_KEYS}


class RouterKind:
    """What a model's config and the engine read from a router kind: its flags and its rules. The hooks that
    take a model's config type it `Any`: moe_serve.model_config imports this module, so naming its classes
    here would close an import circle; each kind's override names them (`MoEConfig`, `ModelConfig`)."""

    kind: ClassVar[str] = ""
    Config: ClassVar[type[RouterConfig]] = RouterConfig  # the kind's settings
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

    @classmethod
    def tensor_shapes(cls, config: RouterConfig, num_experts: int) -> dict[str, tuple[int, ...]]:
        """The kind's own tensors per MoE layer besides the router linear, name -> shape (DeepSeek-V3's
        correction bias, say). The MoE block holds them on the router linear, so an artifact stores them as
        `moe.router.<name>`, in fp32 as router weights are, and hands them to `Router.bind` once loaded.
        {}: none."""
        return {}

    @classmethod
    def max_k_reason(cls, moe: Any) -> str | None:
        """Why no k above the model's experts_per_token.max can be served, when the kind's own rule sets that
        bound (a request past it is refused with this reason); None: the model's range alone. moe: MoEConfig."""
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

    @classmethod
    def check_moe(cls, moe: Any) -> None:
        """Refuse (ConfigError) an MoE section (MoEConfig) this kind cannot serve. By default: no HyperMoE
        adapters, which only the hyper_expert kind reads."""
        if moe.hyper_expert is not None:
            raise ConfigError("moe.hyper_expert (the HyperMoE adapters) goes with router kind hyper_expert, and only")

    @classmethod
    def check_model(cls, config: Any) -> None:
        """Refuse (ConfigError) a model (ModelConfig) this kind cannot serve."""
        if cls.per_sequence and config.task != "sequence_classification":
            raise ConfigError(
                f"router kind {cls.kind} decides once per complete input, so it is served for task "
                f"sequence_classification only; this config has task {config.task}"
            )

    @classmethod
    def onnx_refusal(cls, config: Any) -> str | None:
        """Why the ONNX graph cannot express this kind in model `config` (a ModelConfig; None: it can). The
        export traces the model's own layers, so a kind that reads only its logits exports as it is served;
        one that keeps per-token state in the cache cannot, as the graph carries only keys and values
        between runs."""
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


K = TypeVar("K", bound=type[RouterKind])


def register(kind: str) -> Callable[[K], K]:
    """Class decorator: the kind named `kind` (config.json's `moe.router.kind`)."""

    def add(cls: K) -> K:
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


def router_class(kind: str) -> type[RouterKind]:
    """The registered kind `kind` (its rules; the layers' `make_router` builds its Router)."""
    return _REGISTRY[kind]


def router_config(kind: str, **settings: Any) -> RouterConfig:
    """The config of router kind `kind` with its settings (ConfigError for an unknown kind or setting)."""
    if kind not in _REGISTRY:
        raise ConfigError(f"router kind must be one of {_known()}; got {kind!r}")
    config_cls = _REGISTRY[kind].Config
    unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(config_cls)})
    if unknown:
        raise ConfigError(f"router kind {kind} has no setting {', '.join(unknown)}")
    return config_cls(kind=kind, **settings)


def _known() -> str:
    """The registered kinds, for an error; none means nothing imported moe_serve.layers.routers yet."""
    if not _REGISTRY:
        return "the registered kinds (none are: import moe_serve.layers.routers first, which registers them)"
    return ", ".join(router_kinds())
