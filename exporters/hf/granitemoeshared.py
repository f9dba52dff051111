"""Granite-MoE with a shared expert (`granitemoeshared`): Granite-MoE plus its shared MLP
(`shared_intermediate_size`, fused as the experts are, with no gate on its output), always on."""

from __future__ import annotations

import torch

from moe_serve.exporters.base import SafetensorsCheckpoint
from moe_serve.exporters.hf.family import register
from moe_serve.exporters.hf.granitemoe import GraniteMoe, fused_glu


@register
class GraniteMoeShared(GraniteMoe):
    name = "Granite-MoE-shared"
    architectures = ("GraniteMoeSharedForCausalLM",)
    shared_expert_size_key = "shared_intermediate_size"
    shared_expert_prefix = "shared_mlp"

    def shared_expert_weights(
        self, checkpoint: SafetensorsCheckpoint, src: str, dst: str, d: int, i: int
    ) -> dict[str, torch.Tensor]:
        return fused_glu(checkpoint, src, dst, (), d, i)
