"""`topk_softmax`: top-k by logit. normalize=true: softmax over the chosen logits (Mixtral, HyperRouter,
SMoE); normalize=false: the chosen experts' full-softmax probabilities, whose sum shrinks with k
(Qwen2-MoE, OLMoE)."""

from __future__ import annotations

from dataclasses import dataclass

from moe_serve.kernels.vocabulary import Weighting
from moe_serve.layers.routers.base import Router
from moe_serve.router_registry import RouterConfig, register


@dataclass(frozen=True, slots=True)
class TopKSoftmaxConfig(RouterConfig):
    normalize: bool = True  # softmax over the chosen (True) or their full-softmax mass (False)

    def describe(self) -> str:
        return self.kind if self.normalize else f"{self.kind} (normalize=false)"


@register("topk_softmax")
class TopKSoftmax(Router):
    Config = TopKSoftmaxConfig
    top_p_defined = True
    onnx_graph = True

    def __init__(self, config: RouterConfig, num_experts: int) -> None:
        super().__init__(config, num_experts)
        assert isinstance(config, TopKSoftmaxConfig)
        self.weighting = Weighting.SOFTMAX_CHOSEN if config.normalize else Weighting.SOFTMAX_ALL
