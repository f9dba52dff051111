"""Test helpers: token-packed batches from padded ones and back, and a switch to the torch kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_serve.kernels import ops
from moe_serve.layers.batch import AdaptiveK, ForwardBatch
from moe_serve.moe_policy import KSpec

# The two CPU paths a test runs on: the C++ kernels' case carries their marker (skipped where they do not build).
KERNELS = [pytest.param("cpu", marks=pytest.mark.cpu_kernels), "torch"]


def use_kernels(monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    """Run with the C++ CPU kernels ("cpu", the default where they build) or the plain torch ones."""
    if which == "torch":
        monkeypatch.setattr(ops, "_cpu_ext", lambda x: None)
    elif ops._cpu_ext(torch.zeros(1)) is None:
        # Only for a "cpu" case without the cpu_kernels marker (one not parametrized by KERNELS): skipped here
        # rather than failing on the torch path.
        pytest.skip("the CPU kernels are not built on this machine")


def packed_batch(
    lengths: list[int], ks: list[int], policies: list[tuple[float, int] | None] | None = None, num_layers: int = 1
) -> ForwardBatch:
    """Whole sequences, no cache: what the runner builds for a bidirectional or first-chunk step.
    policies: per sequence, None (exactly its k) or (p, min_k), top-p with its k as the max."""
    batch = ForwardBatch.whole_sequences(lengths, ks)
    if policies is None:
        return batch
    specs = [KSpec(k) if pm is None else KSpec(k, pm[0], pm[1]) for k, pm in zip(ks, policies, strict=True)]
    adaptive = AdaptiveK(
        cut=torch.tensor([s.cut for s, n in zip(specs, lengths, strict=True) for _ in range(n)]),
        min_k=torch.tensor([s.lowest for s, n in zip(specs, lengths, strict=True) for _ in range(n)]),
        experts_used=torch.zeros(num_layers, len(lengths), dtype=torch.int64),
    )
    return dataclasses.replace(batch, adaptive_k=adaptive)


def pack(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, L, D] with a token mask [B, L] -> [T, D]."""
    return x[mask]


def unpack(y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[T, D] -> [B, L, D], zeros where the mask is False."""
    out = y.new_zeros(*mask.shape, y.shape[-1])
    out[mask] = y
    return out
