"""Tensor and expert parallelism for the plugin's model (vLLM's `--tensor-parallel-size N`, with
`--enable-expert-parallel`): which share of each artifact tensor a rank keeps.

Megatron's split, as vLLM's own MoE models do it, on moe-serve's layers:
- attention: each rank keeps H/N query heads and their key/value heads (G/N, or, where G < N, the one
  key/value head its query heads read, replicated), the matching rows of q/k/v and columns of o_proj;
- every FFN (dense layers, shared experts, HyperMoE's adapter table, and the experts under plain tensor
  parallelism): its first linear maps split by output rows, its last by input columns;
- expert parallelism: each rank keeps E/N whole experts; a token's slots on other ranks' experts are -1
  here (`MoEBlock.local_experts`), computed there;
- the router, norms, embedding and LM head are replicated: every rank routes identically.
Each rank's attention output and FFN output is then a partial sum; one all-reduce after each (the model
does it) gives every rank the full hidden state. A last linear map's bias is kept by rank 0 only, so the
sum counts it once. Pure torch: vLLM supplies the rank, the world size and the all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_serve.layers.attention import Attention
from moe_serve.layers.ffn import FFN, ExpertBank
from moe_serve.layers.moe import MoEBlock
from moe_serve.model_config import FFNConfig, ModelConfig

# Each FFN kind's linear maps: those applied first (split by output rows) and the last (split by columns).
FIRST = {"mlp": ("fc1",), "glu": ("gate_proj", "up_proj"), "adapter": ("down",)}


@dataclass(frozen=True, slots=True)
class Shards:
    rank: int
    size: int  # the tensor-parallel world size; 1: nothing is split
    experts: bool = False  # expert parallelism: whole experts per rank instead of a slice of each

    def split(self, n: int) -> tuple[int, int]:
        """(first, count) of this rank's share of n equal units (n divisible by size)."""
        count = n // self.size
        return self.rank * count, count

    def kv_heads(self, g: int) -> tuple[int, int]:
        """(first, count) of the key/value heads this rank's query heads read."""
        if g >= self.size:
            return self.split(g)
        return self.rank * g // self.size, 1


def problems(config: ModelConfig, shards: Shards) -> list[str]:
    """Why this model cannot be split this way, each named (empty: it can)."""
    n = shards.size
    if n == 1:
        return []
    h, g = config.num_heads, config.num_kv_heads
    assert h is not None and g is not None
    found = []
    if h % n:
        found.append(f"num_heads {h} is not divisible by tensor_parallel_size {n}")
    if g % n if g >= n else n % g:
        found.append(f"num_kv_heads {g} and tensor_parallel_size {n}: one must divide the other")
    if config.qk_norm == "full" and g < n:
        found.append(
            f"a q/k norm over all heads (qk_norm: full) with fewer key/value heads ({g}) than tensor_parallel_size"
        )
    ffns: list[tuple[str, FFNConfig]] = []
    if config.moe is None or len(config.moe.layers) < config.num_layers:
        ffns.append(("ffn", config.ffn))
    moe = config.moe
    if moe is not None:
        if shards.experts:
            if moe.num_experts % n:
                found.append(f"num_experts {moe.num_experts} is not divisible by the expert-parallel size {n}")
        else:
            ffns.append(("expert", moe.expert))
        if moe.shared_expert is not None:
            ffns.append(("shared_expert", moe.shared_expert))
        if moe.hyper_expert is not None:
            ffns.append(("hyper_expert", moe.hyper_expert))
    for what, ffn in ffns:
        if ffn.intermediate_size % n:
            found.append(f"{what} intermediate_size {ffn.intermediate_size} is not divisible by {n}")
    return found


def shard(model: torch.nn.Module, name: str, tensor: torch.Tensor, shards: Shards) -> torch.Tensor:
    """This rank's share of the artifact tensor `name` (the tensor itself where it is replicated)."""
    if shards.size == 1:
        return tensor
    path, _, leaf = name.rpartition(".")
    parent_path, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    if isinstance(parent, Attention):
        return _attention(parent, child, leaf, tensor, shards)
    if isinstance(parent, FFN | ExpertBank):
        bank = isinstance(parent, ExpertBank)
        holder = model.get_submodule(parent_path.rpartition(".")[0]) if bank else None
        if bank and shards.experts and isinstance(holder, MoEBlock) and holder.experts is parent:
            first, count = shards.split(parent.num_experts)
            return tensor.narrow(0, first, count)
        dim = 1 if bank else 0  # an expert bank's tensors are [E, out, in] and [E, out]
        if child in FIRST[parent.config.kind]:
            first, count = shards.split(tensor.shape[dim])
            return tensor.narrow(dim, first, count)
        if leaf == "bias":
            return tensor if shards.rank == 0 else torch.zeros_like(tensor)
        first, count = shards.split(tensor.shape[dim + 1])
        return tensor.narrow(dim + 1, first, count)
    return tensor


def _attention(attention: Attention, child: str, leaf: str, tensor: torch.Tensor, shards: Shards) -> torch.Tensor:
    dh = attention.head_dim
    h = attention.config.num_heads
    g = attention.config.num_kv_heads
    assert h is not None and g is not None
    q_first, q_count = shards.split(h)
    kv_first, kv_count = shards.kv_heads(g)
    if child == "q_proj" or (child == "q_norm" and attention.qk_norm == "full"):
        return tensor.narrow(0, q_first * dh, q_count * dh)
    if child in ("k_proj", "v_proj") or (child == "k_norm" and attention.qk_norm == "full"):
        return tensor.narrow(0, kv_first * dh, kv_count * dh)
    if child == "o_proj":
        if leaf == "bias":
            return tensor if shards.rank == 0 else torch.zeros_like(tensor)
        return tensor.narrow(1, q_first * dh, q_count * dh)
    return tensor  # per-head q/k norms: the same weight for every head
