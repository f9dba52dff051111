"""The C++ CPU kernels directly: a row's result is bitwise the same whatever the number of rows beside it
(they take different block shapes by row count: one row of W at a time up to 4 rows of X, register blocks
above (5x5 with AVX-512, 2x2 with AVX2), single-row tails), and close to PyTorch's."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from moe_serve.kernels import cpu_extension, target_isa
from moe_serve.kernels.vocabulary import Weighting

pytestmark = pytest.mark.cpu_kernels

ROWS = (1, 2, 3, 4, 5, 6, 9, 10, 11, 64, 67)


def test_the_build_uses_the_widest_vectors_allowed() -> None:
    assert cpu_extension().isa() == target_isa()  # what the compiler's macros chose is what Python expects


def test_the_kernel_reads_the_weighting_codes_python_sends() -> None:
    """vocabulary.Weighting (what the router kinds name) and the C++ enum are one table."""
    assert cpu_extension().weighting_codes() == {w.name.lower(): w.value for w in Weighting}


@pytest.mark.parametrize("n", [1, 4, 5, 13, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_are_batch_invariant(n: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(n)
    weight = torch.randn(n, 40, generator=generator).to(dtype)  # K = 40: two full 16-wide steps and a tail
    bias = torch.randn(n, generator=generator)
    x = torch.randn(max(ROWS), 40, generator=generator)
    alone = torch.cat([cpu_extension().linear(x[i : i + 1], weight, bias) for i in range(len(x))])
    for m in ROWS:
        assert torch.equal(cpu_extension().linear(x[:m], weight, bias), alone[:m]), m
    torch.testing.assert_close(alone, F.linear(x, weight.float(), bias), rtol=1e-5, atol=1e-5)


def test_moe_experts_rows_are_batch_invariant() -> None:
    """Up to 67 tokens over 4 experts: each expert's group crosses every block shape as the batch grows."""
    generator = torch.Generator().manual_seed(0)
    experts, d, inner = 4, 48, 37
    w1 = torch.randn(experts, inner, d, generator=generator) * 0.2
    w3 = torch.randn(experts, inner, d, generator=generator) * 0.2
    w2 = torch.randn(experts, d, inner, generator=generator) * 0.2
    x = torch.randn(max(ROWS), d, generator=generator)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:2] for _ in range(len(x))])
    ids[::3, 1] = -1  # every third token uses one expert
    weights = torch.rand(len(x), 2, generator=generator)

    def moe(rows: slice) -> torch.Tensor:
        return cpu_extension().moe_experts(x[rows], ids[rows], weights[rows], w1, None, w3, None, w2, None, 3, 0.0, 0.0)

    alone = torch.cat([moe(slice(i, i + 1)) for i in range(len(x))])
    for m in ROWS:
        assert torch.equal(moe(slice(0, m)), alone[:m]), m
