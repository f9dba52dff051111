"""gpt-oss's clamped SwiGLU experts ("swigluoai") in ops.moe_experts, C++ (fp32 and packed banks) and torch
paths, against transformers' own GptOssExperts on the same weights, with pre-activations large enough that
both clamps act."""

from __future__ import annotations

import pytest
import torch

from moe_serve.kernels import ops
from moe_serve.kernels.packed import WeightFormat, quantize
from moe_serve.kernels.vocabulary import ExpertWeights, SwiGLUClamp

E, D, I, T, K = 4, 32, 64, 9, 2
ALPHA, LIMIT = 1.702, 7.0
PATHS = [pytest.param("cpp", marks=pytest.mark.cpu_kernels), "torch"]


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "gate": torch.randn(E, I, D, generator=gen) * 0.6,  # |pre-activation| up to ~15: beyond the limit of 7
        "up": torch.randn(E, I, D, generator=gen) * 0.6,
        "down": torch.randn(E, D, I, generator=gen) * 0.1,
        "b_gate": torch.randn(E, I, generator=gen),
        "b_up": torch.randn(E, I, generator=gen),
        "b_down": torch.randn(E, D, generator=gen),
    }


def _transformers_experts(w: dict[str, torch.Tensor]):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=D, intermediate_size=I, num_local_experts=E, swiglu_limit=LIMIT)
    config.swiglu_alpha = ALPHA
    experts = GptOssExperts(config)
    with torch.no_grad():  # its layout: [E, D, 2I] with gate and up interleaved along the last axis
        experts.gate_up_proj.copy_(torch.stack([w["gate"], w["up"]], dim=2).reshape(E, 2 * I, D).transpose(1, 2))
        experts.gate_up_proj_bias.copy_(torch.stack([w["b_gate"], w["b_up"]], dim=2).reshape(E, 2 * I))
        experts.down_proj.copy_(w["down"].transpose(1, 2))
        experts.down_proj_bias.copy_(w["b_down"])
    return experts


def _routing(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return ids, torch.softmax(torch.randn(T, K, generator=gen), dim=-1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", [WeightFormat.FP32, WeightFormat.INT8])
def test_clamped_swiglu_experts_equal_transformers(path: str, fmt: WeightFormat, monkeypatch) -> None:
    w = _weights(0)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(1)) * 2
    ids, weights = _routing(2)
    pack = (lambda t: t) if fmt is WeightFormat.FP32 else (lambda t: quantize(t, fmt))
    if fmt is not WeightFormat.FP32:  # the reference gets the values the packed bank holds
        w = {**w, **{n: quantize(w[n], fmt).dequantize() for n in ("gate", "up", "down")}}
    up = {"w3": pack(w["up"]), "b3": w["b_up"]}
    swiglu = SwiGLUClamp(ALPHA, LIMIT)
    bank = ExpertWeights(
        pack(w["gate"]), pack(w["down"]), "swigluoai", w["b_gate"], **up, b2=w["b_down"], swiglu=swiglu
    )
    if path == "torch":
        monkeypatch.setattr(ops, "_cpu_ext", lambda x: None)
    got = ops.moe_experts(x, ids, weights, bank)
    with torch.no_grad():
        want = _transformers_experts(w)(x, ids, weights)
    gate = torch.einsum("td,eid->tei", x, w["gate"]) + w["b_gate"]
    assert (gate.abs() > LIMIT).float().mean() > 0.05, "the clamps must act in this test"
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.cpu_kernels
def test_the_clamped_swiglu_needs_gated_experts_and_a_limit() -> None:
    ext = ops._cpu_ext(torch.zeros(1))
    assert ext is not None
    w = _weights(3)
    x = torch.randn(T, D)
    ids, weights = _routing(4)
    with pytest.raises(RuntimeError, match="clamped SwiGLU needs gated experts"):
        ext.moe_experts(x, ids, weights, w["gate"], None, None, None, w["down"], None, 4, ALPHA, LIMIT)
    with pytest.raises(RuntimeError, match="positive limit"):
        ext.moe_experts(x, ids, weights, w["gate"], None, w["up"], None, w["down"], None, 4, ALPHA, 0.0)
