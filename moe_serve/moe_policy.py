"""Adaptive experts per token (docs/architecture.md §3): a request's `moe` policy, and the k spec the
engine runs every request with.

`MoEPolicy` is what a request asks for, checked on its own (errors name `moe.<field>`); the HTTP schema
(moe_serve.api.protocol) declares the same ranges. `KSpec` is the request's k once resolved against a
model (moe_serve.engine.inputs): a fixed k, top-p between min_k and k, or "auto" (the engine sets k
each step from its latency target: moe_serve.engine.auto_k). The engine and the MoE layers only ever see
a KSpec.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moe_serve.errors import ValidationError
from moe_serve.validation import check_int, check_number

POLICIES = ("top_p",)
AUTO = "auto"  # experts_per_token: "auto": the server picks k under its latency target


@dataclass(frozen=True, slots=True)
class MoEPolicy:
    """top_p: each token takes experts in order of router probability (largest first) until their
    full-softmax probabilities sum to at least `p`, then clamped to [min, max] (None: the model's range).
    p = 1 means every token takes `max`."""

    policy: str = "top_p"
    p: float = 1.0
    min: int | None = None
    max: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValidationError(
                f"moe.policy must be one of {', '.join(POLICIES)}, got {self.policy!r}",
                parameter="moe.policy",
                value=self.policy,
            )
        check_number("moe.p", self.p, 0.0, 1.0)
        if self.p == 0:
            raise ValidationError("moe.p must be greater than 0, got 0", parameter="moe.p", value=0)
        for name in ("min", "max"):
            if getattr(self, name) is not None:
                check_int(f"moe.{name}", getattr(self, name), 1)
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValidationError(
                f"moe.min ({self.min}) must not be greater than moe.max ({self.max})", parameter="moe.min"
            )

    @classmethod
    def of(cls, value: MoEPolicy | Mapping[str, Any] | None) -> MoEPolicy | None:
        """A policy from itself or a mapping (JSON, Python API); unknown keys are refused by name."""
        if value is None or isinstance(value, MoEPolicy):
            return value
        if not isinstance(value, Mapping):
            raise ValidationError(f"moe must be an object, got {type(value).__name__}", parameter="moe")
        unknown = sorted(set(value) - {"policy", "p", "min", "max"})
        if unknown:
            raise ValidationError(f"moe has no field {unknown[0]!r}", parameter=f"moe.{unknown[0]}")
        if "policy" not in value:
            raise ValidationError("moe.policy is required", parameter="moe.policy")
        if "p" not in value:
            raise ValidationError("moe.p is required", parameter="moe.p")
        return cls(**value)

    @property
    def name(self) -> str:
        """How quality tables and plots name it: "top_p=0.8" (with ",min=..,max=.." when set)."""
        bounds = "".join(f",{n}={v}" for n, v in (("min", self.min), ("max", self.max)) if v is not None)
        return f"{self.policy}={self.p:g}{bounds}"

    @classmethod
    def parse_sweep(cls, text: str) -> list[MoEPolicy]:
        """ "top_p=0.6,0.8,0.9" (the command line's --moe) -> one policy per p; errors name `moe`."""
        policy, sep, values = text.partition("=")
        if not sep or policy not in POLICIES or not values:
            raise ValidationError(
                f"--moe must look like top_p=0.6,0.8,0.9 (policies: {', '.join(POLICIES)}), got {text!r}",
                parameter="moe",
            )
        try:
            ps = [float(v) for v in values.split(",")]
        except ValueError:
            raise ValidationError(
                f"--moe takes comma-separated numbers after '=', got {text!r}", parameter="moe"
            ) from None
        return [cls(policy, p) for p in ps]


@dataclass(frozen=True, slots=True)
class KSpec:
    """How many experts each token of a request takes: exactly `k`, or (top_p set) the fewest whose router
    probability reaches top_p, between min_k and k. `k` is also the width the layers route with.

    `auto`: the server chooses k. As resolved for a request, min_k..k is the range it may choose from
    (the model's); before each step the engine gives the sequence KSpec(k_now, auto=True), the k that
    step runs it with (so a step still sees one exact k per row, and batch invariance holds per step)."""

    k: int
    top_p: float | None = None
    min_k: int | None = None  # with top_p, or the lowest k "auto" may choose
    auto: bool = False

    @classmethod
    def auto_at(cls, k: int) -> KSpec:
        """An "auto" sequence's spec for one step: it runs at exactly k."""
        return cls(k, auto=True)

    @classmethod
    def of(cls, value: int | KSpec) -> KSpec:
        return value if isinstance(value, KSpec) else cls(value)

    @property
    def adaptive(self) -> bool:
        return self.top_p is not None

    @property
    def lowest(self) -> int:
        """The fewest experts a token may take."""
        return self.min_k if self.min_k is not None else self.k

    @property
    def cut(self) -> float:
        """The cumulative probability a token stops at; inf for "never stop before k" (a fixed k, or p = 1,
        which fp32 sums might reach early through rounding)."""
        return self.top_p if self.top_p is not None and self.top_p < 1.0 else math.inf

    @property
    def k_varies(self) -> bool:
        """Whether the request left its k to the model or the server (a top-p policy, or "auto"): then
        results report the mean k its tokens took, not one k."""
        return self.adaptive or self.auto

    @property
    def policy(self) -> str:
        return "top_p" if self.adaptive else AUTO if self.auto else "fixed"

    @property
    def label(self) -> str:
        """Metric label: the fixed k, or the policy's name ("top_p", "auto")."""
        return self.policy if self.k_varies else str(self.k)
