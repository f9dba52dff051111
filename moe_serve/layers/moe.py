"""The MoE block: a router (one module per kind, moe_serve.layers.routers) turning fp32 logits into
(topk_ids, topk_weights) with k per token, an expert bank, and an optional (gated) shared expert.

Legend: T tokens of the step (packed), S sequences, N experts, K slots (the batch's largest k), D hidden.

Router rules (docs/architecture.md §3): logits in fp32; ties go to the lower expert index; no noise, no capacity limit.
Slots beyond a token's own k get id -1 and weight 0 and are never computed. Under a top-p policy a token's
k is chosen here from its router probabilities (ops.top_p_k) before the router weighs the chosen, so every
router mode applies unchanged to whatever k a token ends up with.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_serve.kernels import ops, sequences
from moe_serve.kernels.vocabulary import AttentionBatch, ExpertWeights, sigmoid
from moe_serve.layers.batch import AttentionInputs, ForwardBatch
from moe_serve.layers.ffn import FFN, ExpertBank
from moe_serve.layers.norm import make_norm
from moe_serve.layers.routers import PooledRouterConfig, Router, RouterState, make_router
from moe_serve.layers.routers.hyper_expert import pattern_index
from moe_serve.model_config import MoEConfig


class MoEBlock(nn.Module):
    def __init__(self, config: MoEConfig, hidden_size: int, norm_eps: float) -> None:
        super().__init__()
        self.config = config
        self.router = nn.Linear(hidden_size, config.num_experts, bias=config.router.use_bias)
        # A per-sequence kind routes its input's pooled mean, normed first when its settings say so.
        self.input_norm = config.router.input_norm if isinstance(config.router, PooledRouterConfig) else None
        if self.input_norm is not None:
            self.router_norm = make_norm(self.input_norm, hidden_size, norm_eps)
        self.experts = ExpertBank(config.expert, hidden_size, config.num_experts)
        if config.shared_expert is not None:
            self.shared_expert = FFN(config.shared_expert, hidden_size)
            if config.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.router_kind: Router = make_router(config.router, config.num_experts)
        # The kind's own tensors (DeepSeek-V3's correction bias) live on the router linear: `moe.router.<name>`,
        # stored and loaded in fp32 as its weight is; the kind gets them through bind.
        self._kind_tensors = tuple(type(self.router_kind).tensor_shapes(config.router, config.num_experts).items())
        for name, shape in self._kind_tensors:
            self.router.register_parameter(name, nn.Parameter(torch.zeros(shape)))
        self._stateful = type(self.router_kind).state_size(config.num_experts, hidden_size) > 0
        if config.hyper_expert is not None:  # HyperMoE: one adapter per selected set (routers.hyper_expert)
            self.hyper = ExpertBank(config.hyper_expert, hidden_size, config.num_patterns)
        # Tokens routed to each expert since the last read ([N] int64), when load tracking is on.
        self.expert_load: torch.Tensor | None = None
        # (first, count): the experts this process's bank holds when another process holds the rest (the vLLM
        # plugin's expert parallelism); slots routed elsewhere are skipped here. None: the bank holds all.
        self.local_experts: tuple[int, int] | None = None
        self._router: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by prepare()
        self._bank: ExpertWeights | None = None
        self._hyper_bank: ExpertWeights | None = None

    def _count(self, topk_ids: torch.Tensor, batch: ForwardBatch, tokens_per_row: torch.Tensor | None = None) -> None:
        """Tokens routed to each expert: into expert_load (engine) and batch.expert_counts (ONNX graph).
        tokens_per_row: a per-sequence decision stands for each of its tokens."""
        if batch.expert_counts is not None:  # one-hot sums: no bincount, whose output size a trace cannot follow
            experts = torch.arange(self.config.num_experts, device=topk_ids.device)
            hits = topk_ids[..., None] == experts  # [R, K, N]; -1 (unused slot, padding) matches none
            if tokens_per_row is not None:
                hits = hits * tokens_per_row[:, None, None].long()
            batch.expert_counts.append(hits.sum((0, 1)).to(torch.int64))
        if self.expert_load is None:
            return
        # A scatter-add of each slot's tokens (0 for an unused slot): no boolean indexing or bincount, whose
        # sizes would need a device-to-host read (a CUDA graph cannot hold one; every step would wait on it).
        tokens = (topk_ids >= 0).long()
        if tokens_per_row is not None:
            tokens = tokens * tokens_per_row[:, None].long()
        self.expert_load.scatter_add_(0, topk_ids.clamp(min=0).flatten(), tokens.flatten())

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self._router if self._router is not None else self._router_weights()
        return ops.linear(x.float(), weight, bias)

    def _router_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.router.weight.float(), None if self.router.bias is None else self.router.bias.float()

    def _bind_kind_tensors(self) -> None:
        if self._kind_tensors:
            self.router_kind.bind({name: getattr(self.router, name).float() for name, _ in self._kind_tensors})

    @torch.no_grad()
    def prepare(self) -> None:
        """After loading: the router in fp32 and the expert bank in the kernel's terms, looked up once."""
        self._router = self._router_weights()
        self._bind_kind_tensors()
        self._bank = self.experts.weights()
        self._hyper_bank = self.hyper.weights() if self.config.hyper_expert is not None else None

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, layer: int, attention: AttentionInputs | None = None
    ) -> torch.Tensor:
        """x [T, D] -> [T, D]; attention: the same layer's attention, for a router that reads it."""
        if self.router_kind.per_sequence:
            out = self._forward_per_sequence(x, batch)
        else:
            state = None
            # Stateful kinds and top-p policies run in the engine's packed steps only (neither exports to a graph).
            assert isinstance(batch.attention, AttentionBatch) or not (self._stateful or batch.adaptive_k)
            if self._stateful:
                assert isinstance(batch.attention, AttentionBatch)
                cache = batch.router_states[layer] if batch.router_states else None
                moe_layer = self.config.layers.index(layer) if layer in self.config.layers else 0
                state = RouterState(cache, batch.attention, batch.block_size, x, attention, moe_layer)
            if self._router is None:  # not prepared (a block used on its own): the kind's tensors as they are now
                self._bind_kind_tensors()
            logits = self.router_logits(x)
            token_k = batch.token_k
            if batch.adaptive_k is not None:  # only kinds with top_p_defined get here (moe_serve.engine.inputs)
                adaptive = batch.adaptive_k
                assert isinstance(batch.attention, AttentionBatch)
                token_k = ops.top_p_k(logits, adaptive.cut, adaptive.min_k, token_k, batch.max_k)
                adaptive.experts_used[layer].index_add_(0, batch.attention.seq_ids, token_k)
            topk_ids, topk_weights = self.router_kind.route(logits, token_k, batch.max_k, state)
            self._count(topk_ids, batch)
            out = self._routed_experts(x, self._bank_ids(topk_ids), topk_weights)
            if self.config.hyper_expert is not None:
                out = out + self._hyper_experts(x, topk_ids)
        if self.config.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.config.shared_expert_gate:
                shared = sigmoid(ops.linear(x, self.shared_expert_gate.weight)) * shared
            out = out + shared
        return out

    def _routed_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_j w_j E_j(x), or with MoEConfig.weights_scale_input (Llama 4) sum_j E_j(w_j x): then each slot is
        a row of its own with weight 1, and the rows are added in slot order (batch-invariant)."""
        bank = self._bank or self.experts.weights()
        if not self.config.weights_scale_input:
            return ops.moe_experts(x, ids, weights, bank)
        t, k = ids.shape
        scaled = (x[:, None, :] * weights[..., None].to(x.dtype)).reshape(t * k, -1)  # [T * K, D]
        ones = torch.ones(t * k, 1, dtype=torch.float32, device=x.device)
        per_slot = ops.moe_experts(scaled, ids.reshape(t * k, 1), ones, bank).reshape(t, k, -1)  # unused slot: 0
        out = per_slot[:, 0]
        for j in range(1, k):
            out = out + per_slot[:, j]
        return out

    def _bank_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Expert ids -> indices into this process's bank, -1 for experts it does not hold."""
        if self.local_experts is None:
            return topk_ids
        first, count = self.local_experts
        local = topk_ids - first
        return torch.where((local >= 0) & (local < count), local, -1)  # an unused slot (-1) is below every first

    def _hyper_experts(self, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """HyperMoE's adapter of each token's selected set, weight 1, grouped by set as experts are."""
        pattern = pattern_index(topk_ids, self.config.num_experts)[:, None]  # [T, 1]
        ones = torch.ones(pattern.shape, dtype=torch.float32, device=x.device)
        return ops.moe_experts(x, pattern, ones, self._hyper_bank or self.hyper.weights())

    def _forward_per_sequence(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """One routing decision per sequence from the mean of its tokens; every token of the sequence then
        goes through the merged expert (SMEAR), or through each chosen expert (example_topk)."""
        pooled = sequences.sequence_means(x, batch.attention)  # [S, D] fp32
        if self.input_norm is not None:
            pooled = self.router_norm(pooled)
        topk_ids, topk_weights = self.router_kind.route(self.router_logits(pooled), batch.seq_k, batch.max_k)
        self._count(topk_ids, batch, sequences.sequence_lengths(batch.attention))  # every token uses its experts
        if not self.router_kind.merges_experts:
            ids, weights = (
                sequences.to_tokens(topk_ids, batch.attention),
                sequences.to_tokens(topk_weights, batch.attention),
            )
            return ops.moe_experts(x, ids, weights, self._bank or self.experts.weights())
        return self.experts.forward_merged(x, topk_ids, topk_weights, batch.attention)
