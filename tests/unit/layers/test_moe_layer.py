"""The fast MoE path (routing with k per row, grouped experts, merging) against the slow reference."""

from __future__ import annotations

import math

import pytest
import torch

from moe_serve.layers.moe import MoEBlock
from moe_serve.layers.routers import RouterConfig, router_class, router_config
from moe_serve.model_config import ExpertsPerToken, FFNConfig, MoEConfig
from tests.batches import KERNELS, pack, packed_batch, unpack, use_kernels
from tests.reference_moe import reference_moe

N = 6  # experts
D = 16

ROUTERS = {
    "topk_softmax": router_config("topk_softmax"),
    "topk_softmax_unnormalized": router_config("topk_softmax", normalize=False),
    "topk_softmax_bias": router_config("topk_softmax", use_bias=True),
    "topk_uniform": router_config("topk_uniform"),
    "soft_merge": router_config("soft_merge", input_norm="layernorm"),
    "example_topk": router_config("example_topk", input_norm="layernorm"),
    "similarity": router_config("similarity", tau=4.0),
    "similarity_bias": router_config("similarity", use_bias=True, tau=0.5),
    # Phi-3.5-MoE's router, with a threshold wide enough that each step's masked softmax holds several experts.
    "sparsemixer": router_config("sparsemixer", jitter_eps=0.2),
    "topk_sigmoid": router_config("topk_sigmoid"),  # Llama 4's
}
EXPERTS = {
    "mlp_relu_bias": FFNConfig("mlp", 24, "relu", use_bias=True),
    "mlp_gelu": FFNConfig("mlp", 24, "gelu"),
    "glu_silu": FFNConfig("glu", 24, "silu"),
    "adapter_silu": FFNConfig("adapter", 8, "silu"),
}


def make_block(
    router: RouterConfig, expert: FFNConfig, seed: int = 0, k: ExpertsPerToken | None = None, **moe_kwargs
) -> MoEBlock:
    config = MoEConfig(N, (0,), expert, router, k or ExpertsPerToken(default=2), **moe_kwargs)
    block = MoEBlock(config, D, 1e-5)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5 + (1.0 if "norm.weight" in name else 0.0))
    return block.eval()


def batch(seed: int = 1, lengths: tuple[int, ...] = (5, 3, 7, 1)) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(len(lengths), max(lengths), D, generator=generator)
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    return x, mask


def run(block: MoEBlock, x: torch.Tensor, mask: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """The block on the token-packed batch, laid out padded again."""
    with torch.no_grad():
        return unpack(block(pack(x, mask), packed_batch(mask.sum(1).tolist(), ks), 0), mask)


def route(logits: torch.Tensor, token_k: torch.Tensor, max_k: int, config: RouterConfig):
    return router_class(config.kind)(config, logits.shape[1]).route(logits, token_k, max_k)


@pytest.fixture(params=KERNELS, autouse=True)
def kernels(request, monkeypatch) -> str:
    use_kernels(monkeypatch, request.param)
    return request.param


@pytest.mark.parametrize("expert", EXPERTS.values(), ids=EXPERTS.keys())
@pytest.mark.parametrize("router", ROUTERS.values(), ids=ROUTERS.keys())
def test_fast_path_matches_reference_at_every_k(router: RouterConfig, expert: FFNConfig) -> None:
    block = make_block(router, expert)
    x, mask = batch()
    for k in range(1, N + 1):
        ks = [k] * x.shape[0]
        expected = reference_moe(block, x, mask, ks)
        torch.testing.assert_close(run(block, x, mask, ks) * mask[..., None], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("router", ROUTERS.values(), ids=ROUTERS.keys())
def test_mixed_k_batch_matches_reference(router: RouterConfig) -> None:
    block = make_block(router, EXPERTS["glu_silu"], seed=3)
    x, mask = batch(seed=4)
    ks = [1, N, 3, 2]
    expected = reference_moe(block, x, mask, ks)
    torch.testing.assert_close(run(block, x, mask, ks) * mask[..., None], expected, atol=1e-5, rtol=1e-5)


def test_shared_expert_with_sigmoid_gate_matches_reference() -> None:
    block = make_block(
        ROUTERS["topk_softmax_unnormalized"],
        EXPERTS["glu_silu"],
        shared_expert=FFNConfig("glu", 40),
        shared_expert_gate=True,
    )
    x, mask = batch(seed=5)
    ks = [2, 4, 1, 6]
    expected = reference_moe(block, x, mask, ks)
    torch.testing.assert_close(run(block, x, mask, ks) * mask[..., None], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_hyper_expert_adds_the_adapter_of_each_tokens_selected_set(k: int) -> None:
    """HyperMoE at its trained k (Switch weighting: the chosen experts' full-softmax probabilities), the
    adapter table indexed by the selected set, against the reference."""
    block = make_block(
        router_config("hyper_expert", normalize=False),
        EXPERTS["mlp_relu_bias"],
        seed=7,
        k=ExpertsPerToken(default=k, min=k, max=k),
        hyper_expert=FFNConfig("adapter", 6, "relu", use_bias=True),
    )
    assert block.hyper.num_experts == math.comb(N, k)
    x, mask = batch(seed=8)
    ks = [k] * x.shape[0]
    expected = reference_moe(block, x, mask, ks)
    torch.testing.assert_close(run(block, x, mask, ks) * mask[..., None], expected, atol=1e-5, rtol=1e-5)


def test_route_ties_break_to_lower_index_and_unused_slots_are_masked() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5], [2.0, 2.0, 2.0, 2.0]])
    ids, weights = route(logits, torch.tensor([2, 3]), 3, router_config("topk_softmax"))
    assert ids.tolist() == [[1, 2, -1], [0, 1, 2]]
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]]))


def test_route_uniform_and_unnormalized_weights() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    _, uniform = route(logits, torch.tensor([3]), 4, router_config("topk_uniform"))
    torch.testing.assert_close(uniform, torch.tensor([[1 / 3, 1 / 3, 1 / 3, 0.0]]))
    _, raw = route(logits, torch.tensor([2]), 2, router_config("topk_softmax", normalize=False))
    full = torch.softmax(logits, -1)[0]
    torch.testing.assert_close(raw[0], torch.stack([full[3], full[2]]))


def test_slots_beyond_a_rows_k_are_never_computed(monkeypatch: pytest.MonkeyPatch, kernels: str) -> None:
    """The grouped GEMM sees exactly sum(k) token-expert slots, not T * max_k."""
    from moe_serve.kernels import reference

    if kernels == "cpu":
        pytest.skip("the C++ kernel groups only the used slots by construction (a counting sort of ids >= 0)")
    seen_rows = []
    original = reference._grouped_mm

    def spy(x, weight, offsets):
        seen_rows.append(x.shape[0])
        return original(x, weight, offsets)

    monkeypatch.setattr(reference, "_grouped_mm", spy)
    block = make_block(ROUTERS["topk_softmax"], EXPERTS["mlp_gelu"])
    x, mask = batch(lengths=(4, 4))
    run(block, x, mask, [1, 5])
    assert seen_rows == [4 * 1 + 4 * 5] * 2  # fc1 and fc2
