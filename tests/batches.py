"""Test helpers: token-packed batches from padded ones and back, and a switch to the torch kernels."""

from __future__ import annotations

import pytest
import torch

from moe_serve.kernels import ops
from moe_serve.kernels.ops import AttentionBatch
from moe_serve.layers.batch import ForwardBatch

KERNELS = ["cpu", "torch"]


def use_kernels(monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    """Run with the C++ CPU kernels ("cpu", the default where they build) or the plain torch ones."""
    if which == "torch":
        monkeypatch.setattr(ops, "_cpu_ext", lambda x: None)
    elif ops._cpu_ext(torch.zeros(1)) is None:
        pytest.skip("the CPU kernels are not built on this machine")


def packed_batch(lengths: list[int], ks: list[int]) -> ForwardBatch:
    """Whole sequences, no cache: what the runner builds for a bidirectional or first-chunk step."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    attention = AttentionBatch(
        seq_ids=torch.tensor([s for s, n in enumerate(lengths) for _ in range(n)]),
        positions=torch.tensor([p for n in lengths for p in range(n)]),
        num_keys=torch.tensor(lengths),
        seq_starts=torch.tensor(starts),
        seq_lens=tuple(lengths),
        num_keys_host=tuple(lengths),
    )
    top_k = torch.tensor([k for k, n in zip(ks, lengths, strict=True) for _ in range(n)])
    return ForwardBatch(attention, top_k, max(ks))


def pack(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, L, D] with a token mask [B, L] -> [T, D]."""
    return x[mask]


def unpack(y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[T, D] -> [B, L, D], zeros where the mask is False."""
    out = y.new_zeros(*mask.shape, y.shape[-1])
    out[mask] = y
    return out
