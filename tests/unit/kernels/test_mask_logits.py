"""The grammar-mask kernel (csrc/sampling.cpp) against its torch twin: the rows it names keep exactly the tokens
whose bits are set, whatever the words hold (all set, none set, mixed), at a vocabulary that is not a
multiple of 32; the rows it does not name are untouched."""

from __future__ import annotations

import pytest
import torch

from moe_serve.kernels import cpu_extension, ops, reference


@pytest.mark.parametrize("vocab", [257, 1000, 32000])
def test_the_kernel_equals_its_torch_twin(vocab: int) -> None:
    ext = cpu_extension()
    if ext is None:
        pytest.skip("the CPU kernels are not built here")
    generator = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, words), dtype=torch.int32, generator=generator)
    bitmask[0] = -1  # every token allowed
    bitmask[1] = 0  # none
    bitmask[2, ::2] = -1
    bitmask[3, 1::2] = 0
    rows = torch.tensor([6, 0, 3, 2, 5])
    logits = torch.randn(8, vocab, generator=generator)
    expected = logits.clone()
    reference.mask_logits_torch(expected, rows, bitmask)
    ext.mask_logits(logits, rows, bitmask)
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[[1, 4, 7]]).all()  # rows not named
    assert torch.isfinite(logits[6]).all() and torch.isinf(logits[0]).all()


def test_the_dispatcher_takes_the_twin_where_the_kernel_does_not_apply() -> None:
    bitmask = torch.tensor([[0b101]], dtype=torch.int32)
    logits = torch.zeros(2, 3, dtype=torch.float64)  # not float32: the torch twin
    ops.mask_logits(logits, torch.tensor([1]), bitmask)
    assert logits[1].tolist() == [0.0, float("-inf"), 0.0] and logits[0].tolist() == [0.0, 0.0, 0.0]


def test_bad_operands_are_refused() -> None:
    ext = cpu_extension()
    if ext is None:
        pytest.skip("the CPU kernels are not built here")
    with pytest.raises(RuntimeError, match="fewer than"):
        ext.mask_logits(torch.zeros(1, 64), torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="out of range"):
        ext.mask_logits(torch.zeros(1, 32), torch.tensor([3]), torch.zeros(1, 1, dtype=torch.int32))
