"""The vLLM plugin's tensor and expert parallelism (moe_serve.vllm_plugin.parallel), without vLLM: every
rank's share of a layer computes a partial output, and the sum over ranks (what vLLM's all-reduce does)
equals the whole layer's output. tests/vllm/test_plugin_parallel.py runs it in real vLLM."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from moe_serve.layers.attention import Attention
from moe_serve.layers.ffn import FFN
from moe_serve.layers.moe import MoEBlock
from moe_serve.layers.routers import router_config
from moe_serve.model_config import ExpertsPerToken, FFNConfig
from moe_serve.vllm_plugin.parallel import Shards, problems, shard
from tests.batches import KERNELS, packed_batch, use_kernels
from tests.conftest import lm_config, moe_config
from tests.unit.layers.test_moe_layer import D, make_block

LENGTHS = [5, 3, 7, 1]
KS = [1, 3, 6, 2]


def share(module: nn.Module, shards: Shards) -> nn.Module:
    """A copy of the module holding only this rank's share of each parameter."""
    part = copy.deepcopy(module)
    for name, param in module.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        piece = shard(module, name, param.detach(), shards).clone()
        setattr(part.get_submodule(module_name), leaf, nn.Parameter(piece, requires_grad=False))
    if isinstance(part, Attention | MoEBlock):
        part.prepare()  # as the plugin's load_weights does after loading the shares
    return part


def summed_over_ranks(module: nn.Module, size: int, forward, experts: bool = False) -> torch.Tensor:
    total = None
    for rank in range(size):
        part = share(module, Shards(rank, size, experts))
        if experts and isinstance(part, MoEBlock):
            part.local_experts = Shards(rank, size, experts).split(part.config.num_experts)
        with torch.no_grad():
            out = forward(part)
        total = out if total is None else total + out
    assert total is not None
    return total


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("experts", [False, True], ids=["tensor", "expert"])
@pytest.mark.parametrize(
    "expert", [FFNConfig("glu", 24, "silu", use_bias=True), FFNConfig("mlp", 24, "gelu")], ids=["glu", "mlp"]
)
def test_moe_block_shares_sum_to_the_whole_block(
    monkeypatch: pytest.MonkeyPatch, kernels: str, experts: bool, expert: FFNConfig
) -> None:
    """Routed experts (split by intermediate size, or whole experts per rank), a gated shared expert."""
    use_kernels(monkeypatch, kernels)
    block = make_block(
        router_config("topk_softmax", use_bias=True),
        expert,
        seed=3,
        k=ExpertsPerToken(default=2, max=6),
        shared_expert=FFNConfig("glu", 12, "silu"),
        shared_expert_gate=True,
    )
    x = torch.randn(sum(LENGTHS), D, generator=torch.Generator().manual_seed(4))
    batch = packed_batch(LENGTHS, KS)
    with torch.no_grad():
        whole = block(x, batch, 0)
    parts = summed_over_ranks(block, 2 if experts else 3, lambda part: part(x, batch, 0), experts)
    torch.testing.assert_close(parts, whole, atol=1e-5, rtol=1e-5)


def test_hyper_expert_adapter_table_is_split_by_its_bottleneck() -> None:
    block = make_block(
        router_config("hyper_expert", normalize=False),
        FFNConfig("mlp", 24, "relu", use_bias=True),
        seed=7,
        k=ExpertsPerToken(default=2, min=2, max=2),
        hyper_expert=FFNConfig("adapter", 6, "relu", use_bias=True),
    )
    x = torch.randn(sum(LENGTHS), D, generator=torch.Generator().manual_seed(8))
    batch = packed_batch(LENGTHS, [2] * len(LENGTHS))
    with torch.no_grad():
        whole = block(x, batch, 0)
    for experts, size in ((False, 2), (True, 2), (False, 3)):
        parts = summed_over_ranks(block, size, lambda part: part(x, batch, 0), experts)
        torch.testing.assert_close(parts, whole, atol=1e-5, rtol=1e-5)


def test_dense_ffn_with_biases() -> None:
    ffn = FFN(FFNConfig("mlp", 64, "gelu", use_bias=True), 32)
    x = torch.randn(9, 32)
    with torch.no_grad():
        whole = ffn(x)
    torch.testing.assert_close(summed_over_ranks(ffn, 4, lambda part: part(x)), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("num_kv_heads", "size"), [(2, 2), (4, 2), (1, 2), (2, 4)])
def test_attention_ranks_keep_their_heads_and_output_columns(num_kv_heads: int, size: int) -> None:
    """Query heads split evenly; key/value heads split too, or each rank keeps the one its query heads read
    (fewer key/value heads than ranks); the output projection's columns sum to the whole output."""
    config = lm_config(num_heads=4, num_kv_heads=num_kv_heads, attention_bias=True, attention_out_bias=True)
    attention = Attention(config)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in attention.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    x = torch.randn(6, config.hidden_size, generator=generator)
    with torch.no_grad():
        q, k, v = attention.project(x)
    heads_per_rank, group = 4 // size, 4 // num_kv_heads  # query heads per rank, per key/value head
    out = torch.randn(6, 4 * attention.head_dim, generator=generator)
    partial = torch.zeros(6, config.hidden_size)
    for rank in range(size):
        shards = Shards(rank, size)
        part = share(attention, shards)
        part.num_heads = shards.split(4)[1]
        part.num_kv_heads = shards.kv_heads(num_kv_heads)[1]
        with torch.no_grad():
            q_part, k_part, v_part = part.project(x)
            heads = slice(rank * heads_per_rank, (rank + 1) * heads_per_rank)
            torch.testing.assert_close(q_part, q[:, heads])
            # each of this rank's query heads reads the same key/value head as in the whole layer
            kv_of_heads = [h // group for h in range(heads.start, heads.stop)]
            first_kv = shards.kv_heads(num_kv_heads)[0]
            for local, kv in enumerate(kv_of_heads):
                local_kv = local * part.num_kv_heads // part.num_heads
                assert first_kv + local_kv == kv
            torch.testing.assert_close(k_part, k[:, first_kv : first_kv + part.num_kv_heads])
            torch.testing.assert_close(v_part, v[:, first_kv : first_kv + part.num_kv_heads])
            cols = out.view(6, 4, -1)[:, heads].reshape(6, -1)
            partial += part.o_proj(cols)
    with torch.no_grad():
        torch.testing.assert_close(partial, attention.o_proj(out), atol=1e-5, rtol=1e-5)


def test_what_cannot_be_split_is_named() -> None:
    config = lm_config(num_heads=4, num_kv_heads=2, moe=moe_config(num_experts=4, expert=FFNConfig("glu", 50)))
    assert problems(config, Shards(0, 1)) == []
    assert problems(config, Shards(0, 2)) == []
    assert problems(config, Shards(0, 4, experts=True)) == []
    found = " ".join(problems(config, Shards(0, 3)))
    assert "num_heads 4 is not divisible by tensor_parallel_size 3" in found
    assert "num_kv_heads 2 and tensor_parallel_size 3" in found
    assert "expert intermediate_size 50 is not divisible by 3" in found
    assert "num_experts 4 is not divisible by the expert-parallel size 8" in " ".join(
        problems(lm_config(num_heads=8, num_kv_heads=8, ffn=FFNConfig("mlp", 64)), Shards(0, 8, experts=True))
    )
    full_norm = lm_config(num_heads=4, num_kv_heads=1, qk_norm="full")
    assert any("qk_norm: full" in p for p in problems(full_norm, Shards(0, 2)))
