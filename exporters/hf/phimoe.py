"""Phi-3.5-MoE (`phimoe`): Mixtral's layout and every-layer sliding window, with LayerNorm (with bias), biases
on q/k/v/o, its own router kind (`sparsemixer`: moe_serve/layers/routers/sparsemixer.py says what k means
there) and `longrope` rotary."""

from __future__ import annotations

import logging
from typing import Any

from moe_serve.exporters.hf.family import register
from moe_serve.exporters.hf.mixtral import Mixtral
from moe_serve.layers.routers import RouterConfig, router_config
from moe_serve.model_config import RopeScaling, RopeType

logger = logging.getLogger(__name__)


@register
class Phimoe(Mixtral):
    name = "Phi-3.5-MoE"
    architectures = ("PhimoeForCausalLM",)
    attention_out_bias = True
    norm = "layernorm"
    # Phimoe's rotary scales cos/sin by short_mscale/long_mscale for any non-default type, so only the type it
    # ships is served (RopeScaling: longrope).
    rope_types = ("longrope",)

    def rope_scaling(
        self, rope_type: RopeType, settings: dict[str, Any], original: int | None, hf: dict[str, Any]
    ) -> RopeScaling:
        """transformers scales cos/sin by short_mscale (not attention_factor) for every position below
        original_max_position_embeddings, with the short factors (RopeScaling says why only those)."""
        return RopeScaling(
            type="longrope",
            factor=settings.get("factor") or hf["max_position_embeddings"] / original,
            original_max_position_embeddings=original,
            attention_factor=settings["short_mscale"],
            short_factor=tuple(settings["short_factor"]),
        )

    def max_positions(self, hf: dict[str, Any], scaling: RopeScaling | None) -> int:
        """Capped at original_max_position_embeddings: past it transformers switches to the long factors by the
        length of the whole call, which a paged KV cache cannot follow."""
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
        return super().max_positions(hf, scaling)

    def router(self, hf: dict[str, Any]) -> RouterConfig:
        """sparsemixer: eval mode uses router_jitter_noise as its masking threshold."""
        return router_config(
            "sparsemixer", **({"jitter_eps": hf["router_jitter_noise"]} if "router_jitter_noise" in hf else {})
        )
