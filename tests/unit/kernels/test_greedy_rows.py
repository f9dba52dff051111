"""The greedy kernel (csrc/sampling.cpp, greedy_rows) against torch: each row's argmax is torch.argmax's (the
first maximum on ties, the first NaN where there is one) and its finiteness is torch.isfinite(row).all(), at
vocabularies with and without a tail shorter than a vector, for rows with ties, NaN, +inf, -inf, signed zeros
and all-equal values."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from moe_serve.kernels import ops, reference

NAN, INF = float("nan"), float("inf")


def _rows(vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(vocab)
    rows = torch.randn(14, vocab, generator=generator)
    top = rows[1].max()
    rows[1, [3, vocab - 1]] = top + 1  # a tie: the first wins
    rows[2] = 0.5  # all equal
    rows[3, vocab // 2] = NAN
    rows[4, [1, vocab - 2]] = NAN  # two NaN: the first
    rows[5, vocab - 1] = INF  # in the tail where there is one
    rows[6, 0] = -INF
    rows[7] = -INF
    rows[8] = -1.0
    rows[8, [0, 5]] = torch.tensor([-0.0, 0.0])  # signed zeros tie: the first
    rows[9, vocab - 1] = rows[9].max() + 1  # the maximum last
    rows[10, 0] = rows[10].max() + 1  # first
    rows[11, [2, 7]] = torch.tensor([INF, NAN])  # an inf before a NaN: the NaN
    rows[12] = torch.finfo(torch.float32).max  # finite, whose sum overflows
    rows[13, vocab - 1] = torch.finfo(torch.float32).tiny / 4  # a subnormal maximum of an all-negative row
    rows[13, : vocab - 1] = -1.0
    return rows


@pytest.mark.parametrize("vocab", [1, 7, 16, 257, 1000, 32000])
def test_the_kernel_equals_torch(ext: ModuleType, vocab: int) -> None:
    logits = _rows(vocab) if vocab >= 16 else torch.randn(3, vocab)
    tokens, finite = ext.greedy_rows(logits)
    expected_tokens, expected_finite = reference.greedy_rows_torch(logits)
    assert tokens.dtype == torch.int64 and finite.dtype == torch.bool
    assert tokens.tolist() == expected_tokens.tolist()
    assert finite.tolist() == expected_finite.tolist()
    if vocab >= 16:  # the cases above, named
        assert finite.tolist() == [True] * 3 + [False] * 5 + [True] * 3 + [False] + [True] * 2
        assert tokens[1] == 3 and tokens[2] == 0 and tokens[8] == 0 and tokens[13] == vocab - 1


def test_many_rows_split_across_threads_equal_torch(ext: ModuleType) -> None:
    logits = torch.randn(70, 32000, generator=torch.Generator().manual_seed(1))
    logits[33, 100] = NAN
    tokens, finite = ext.greedy_rows(logits)
    assert torch.equal(tokens, logits.argmax(dim=-1)) and finite.sum() == 69 and not finite[33]


def test_a_strided_view_is_read_as_its_values(ext: ModuleType) -> None:
    logits = torch.randn(4, 64).t()  # not contiguous
    tokens, _ = ext.greedy_rows(logits)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_the_dispatcher_takes_torch_where_the_kernel_does_not_apply() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0], [NAN, 0.0, 1.0]], dtype=torch.float64)
    tokens, finite = ops.greedy_rows(logits)
    assert tokens.tolist() == [1, 0] and finite.tolist() == [True, False]


def test_bad_operands_are_refused(ext: ModuleType) -> None:
    with pytest.raises(RuntimeError, match="float32"):
        ext.greedy_rows(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="V > 0"):
        ext.greedy_rows(torch.zeros(2, 0))
