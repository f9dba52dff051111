"""Routers, one module per kind, found by name in a registry. A router turns fp32 router logits into each
row's experts and combine weights, with k per row (DESIGN §3); a kind may keep per-token state in the
paged KV cache (`state_size`). Add a kind: a module here with a `@register("name")` class, its reference
in tests/reference_moe.py, and a line in docs/artifact-format.md."""

from __future__ import annotations

from moe_serve.layers.routers.base import Router, RouterState, register, router_class, router_kinds

# Importing the built-in kinds registers them.
from moe_serve.layers.routers import (  # noqa: E402, F401  isort: skip
    attention_aware,
    example_topk,
    hyper_expert,
    similarity,
    soft_merge,
    topk_softmax,
    topk_uniform,
)

__all__ = ["Router", "RouterState", "register", "router_class", "router_kinds"]
