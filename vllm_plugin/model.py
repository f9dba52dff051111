"""A moe-serve causal LM as a vLLM model: vLLM's paged attention, moe-serve's own norms, rotary tables, FFNs
and MoE block (every stateless router kind and expert kind), parameters under the artifact's own tensor
names. Each token's k comes from `experts_per_token`, which the worker fills before every step.

Legend: T tokens of the step, H query heads, G key/value heads, Dh head dim, D hidden, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.model_executor.layers.attention import Attention as VllmAttention

from moe_serve.artifact import storage_dtype
from moe_serve.kernels import ops
from moe_serve.layers.attention import Attention
from moe_serve.layers.batch import ForwardBatch
from moe_serve.model_config import ModelConfig
from moe_serve.models.transformer import DecoderLayer, MoETransformer
from moe_serve.vllm_plugin import parallel
from moe_serve.vllm_plugin.parallel import Shards


def reduce(partial: torch.Tensor, shards: Shards) -> torch.Tensor:
    """The sum of every rank's partial output (vLLM's tensor-parallel all-reduce; nothing to do alone)."""
    return tensor_model_parallel_all_reduce(partial) if shards.size > 1 else partial


class ShardedRMSNorm(nn.Module):
    """An RMSNorm over all heads (OLMoE's q/k norm) when each rank holds some of them: the mean square is
    summed over every rank's heads."""

    def __init__(self, dim: int, eps: float, shards: Shards) -> None:
        super().__init__()
        self.dim, self.eps, self.shards = dim, eps, shards
        self.weight = nn.Parameter(torch.ones(dim))  # cut to this rank's heads with the other parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        square_sum = reduce(x.float().pow(2).sum(-1, keepdim=True), self.shards)
        return (x.float() * torch.rsqrt(square_sum / self.dim + self.eps) * self.weight.float()).to(x.dtype)


class MoeServeAttention(Attention):
    """moe-serve's attention (its fused projection, q/k norms, clipping and rotary tables) with vLLM's
    Attention holding the keys and values in vLLM's paged cache; under tensor parallelism, this rank's heads
    (parallel.py) and a partial output that the all-reduce completes."""

    def __init__(self, config: ModelConfig, vllm_config: VllmConfig, prefix: str, shards: Shards) -> None:
        super().__init__(config)
        self.shards = shards
        dh = self.head_dim
        full_q, full_k = self.num_heads * dh, self.num_kv_heads * dh  # a "full" q/k norm's width, all heads
        self.num_heads = shards.split(self.num_heads)[1]
        self.num_kv_heads = shards.kv_heads(self.num_kv_heads)[1]
        h, g = self.num_heads, self.num_kv_heads
        if self.qk_norm == "full" and shards.size > 1:
            self.q_norm = ShardedRMSNorm(full_q, config.norm_eps, shards)
            self.k_norm = ShardedRMSNorm(full_k, config.norm_eps, shards)
        self.attn = VllmAttention(
            h, dh, self.scale, num_kv_heads=g, cache_config=vllm_config.cache_config, prefix=f"{prefix}.attn"
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        t, h, g, dh = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.project(x)
        assert self._rotary is not None, "load_weights prepares the rotary tables"
        q, k = ops.rotary_write(q, k, v, (self._rotary[0][positions], self._rotary[1][positions]), None, None)
        out = self.attn(q.reshape(t, h * dh), k.reshape(t, g * dh), v.reshape(t, g * dh).contiguous())
        return reduce(ops.linear(out.reshape(t, h * dh), *self._o), self.shards)  # type: ignore[misc]


@dataclass(frozen=True, slots=True)
class VllmBatch(ForwardBatch):
    """moe-serve's batch (each token's k) with vLLM's positions, which the plugin's attention reads."""

    positions: torch.Tensor | None = None


class MoeServeDecoderLayer(DecoderLayer):
    """moe-serve's decoder layer (norms, FFN or MoE block, pre/post norm) around vLLM's attention."""

    def __init__(self, config: ModelConfig, index: int, vllm_config: VllmConfig, prefix: str, shards: Shards) -> None:
        attention = MoeServeAttention(config, vllm_config, f"{prefix}.attn", shards)
        super().__init__(config, index, attention=attention)
        self.shards = shards
        if self.is_moe and shards.experts:
            self.moe.local_experts = shards.split(self.moe.config.num_experts)

    def _attn(self, x: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, None]:
        assert isinstance(batch, VllmBatch)
        return self.attn(batch.positions, x), None

    def _ffn(self, x: torch.Tensor, batch: ForwardBatch, attention: None) -> torch.Tensor:  # type: ignore[override]
        return reduce(super()._ffn(x, batch, attention), self.shards)


class MoeServeForCausalLM(MoETransformer):
    """moe-serve's causal LM (embedding, decoder layers, final norm, LM head) with the plugin's layers, in
    the call shape vLLM expects."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        config: ModelConfig = vllm_config.model_config.hf_config.model_config
        experts = vllm_config.parallel_config.enable_expert_parallel
        shards = Shards(get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(), experts)
        self.shards = shards

        def make_layer(c: ModelConfig, i: int) -> DecoderLayer:
            return MoeServeDecoderLayer(c, i, vllm_config, f"{prefix}layers.{i}", shards)

        super().__init__(config, make_layer=make_layer)
        self._settle_parameters()
        moe = config.moe
        self.default_k = moe.default_k if moe is not None else 1
        self.min_k = moe.min_k if moe is not None else 1
        self.max_k = moe.max_k if moe is not None else 1
        # Under vLLM's V1 runner (the CPU build's, and the GPU build's with VLLM_USE_V2_MODEL_RUNNER=0), each
        # token's k for the step being run: the worker stages the first T entries in host memory (pinned on
        # CUDA) and copies them to the device without blocking, before each step; a dummy step (vLLM's
        # profiling and warm-up) runs at the default k. The V2 runner passes `experts_per_token` instead
        # (model_state.py).
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        device = torch.device(vllm_config.device_config.device_type)
        # device="cpu" spelled out: vLLM builds the model under `with torch.device("cuda")`, which would make
        # an unnamed device CUDA (and a pinned CUDA tensor is refused).
        self._staged_k = torch.full(
            (max_tokens,), self.default_k, dtype=torch.int64, device="cpu", pin_memory=device.type == "cuda"
        )
        self.experts_per_token = torch.full((max_tokens,), self.default_k, dtype=torch.int64, device=device)

    def _settle_parameters(self) -> None:
        """Each parameter at the shape and dtype load_weights fills: this rank's share (parallel.py), and fp32
        for router weights whatever the model's dtype (moe_serve.artifact.storage_dtype: bf16 rounding flips
        top-k sets). (Building the layers allocates them at full size for a moment: moe-serve's layers are
        built at their full shapes.)"""
        for name, param in list(self.named_parameters()):
            shape = parallel.shard(self, name, torch.empty(param.shape, device="meta"), self.shards).shape
            dtype = storage_dtype(name, param.dtype)
            if shape != param.shape or dtype != param.dtype:
                module_name, _, leaf = name.rpartition(".")
                settled = torch.empty(shape, dtype=dtype, device=param.device)
                setattr(self.get_submodule(module_name), leaf, nn.Parameter(settled, requires_grad=False))

    @staticmethod
    def get_model_state_cls() -> type:
        """vLLM's V2 model runner asks the model for its per-request state (model_state.py)."""
        from moe_serve.vllm_plugin.model_state import MoeServeModelState

        return MoeServeModelState

    def set_experts_per_token(self, per_token: np.ndarray) -> None:
        """The V1 runner's step: its tokens' k, through the host staging buffer in one non-blocking copy. The
        worker calls this inside the runner's `_prepare_inputs`, which vLLM's GPU runner runs under its
        input-preparation event (`synchronize_input_prep`): the previous step's copies from host buffers have
        completed by then, under asynchronous scheduling too, so the staging buffer is free to overwrite."""
        n = len(per_token)
        self._staged_k[:n].copy_(torch.from_numpy(per_token))
        self.experts_per_token[:n].copy_(self._staged_k[:n], non_blocking=True)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    # vLLM's call shape, not MoETransformer's: vLLM calls this model, moe-serve's engine never does.
    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: object = None,
        inputs_embeds: torch.Tensor | None = None,
        experts_per_token: torch.Tensor | None = None,
        **_: object,
    ) -> torch.Tensor:
        """experts_per_token [T]: each token's k from the V2 runner's model state; None: the V1 worker's."""
        h = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        t = h.shape[0]
        # The MoE blocks of stateless routers read only token_k and max_k; max_k is the artifact's largest k,
        # so the shapes never depend on the step's requests. Slots beyond a token's own k are id -1, never computed.
        token_k = experts_per_token[:t] if experts_per_token is not None else self.experts_per_token[:t]
        batch = VllmBatch(attention=None, token_k=token_k, max_k=self.max_k, positions=positions)  # type: ignore[arg-type]
        for layer in self.layers:
            h = layer(h, batch)
        return self.norm(h) if self.config.final_norm else h

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The artifact's tensors under their own names (moe_serve.artifact checked them at export), each
        cut to this rank's share (parallel.py) as it is read."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                raise ValueError(f"model.safetensors has tensor '{name}', which this model does not have")
            param = params[name]
            with torch.no_grad():
                param.copy_(parallel.shard(self, name, tensor, self.shards).to(param.dtype))
            loaded.add(name)
        self.prepare()
        return loaded
