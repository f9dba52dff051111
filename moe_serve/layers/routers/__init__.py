"""Router kinds, one module per kind, found by name in the registry (moe_serve.router_registry;
docs/architecture.md §3). Importing this package registers every built-in kind. A kind turns
fp32 router logits into each row's experts and combine weights, with k per row, and owns its settings,
its weighting, its checks and its reference (see base.py). Add a kind: one module with a
`@register("name")` Router subclass in this package (imported, so registered, with the package) or
anywhere imported before a model names it, and its test.
"""

from __future__ import annotations

import importlib
import pkgutil

from moe_serve.layers.routers.base import PooledRouterConfig, Router, RouterState, make_router
from moe_serve.router_registry import RouterConfig, register, router_class, router_config, router_kinds, unregister


def _register_built_in_kinds() -> None:
    """Import every module of this package: each registers its kind, so a new kind is its module alone."""
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base":
            importlib.import_module(f"{__name__}.{module.name}")


_register_built_in_kinds()

__all__ = [
    "PooledRouterConfig",
    "Router",
    "RouterConfig",
    "RouterState",
    "make_router",
    "register",
    "router_class",
    "router_config",
    "router_kinds",
    "unregister",
]
