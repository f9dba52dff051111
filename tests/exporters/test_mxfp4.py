"""MXFP4 dequantization (exporters.mxfp4) against transformers' own (integrations.mxfp4, the code that loads
gpt-oss checkpoints), on random blocks and scales; and its refusals."""

from __future__ import annotations

import pytest
import torch

from moe_serve.exporters import mxfp4
from moe_serve.exporters.base import ExportError


def random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [*shape, 16] and scales [*shape] as a checkpoint stores them (exponents around 2^0)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(118, 134, shape, generator=gen, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_equals_transformers(dtype: torch.dtype) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4((3, 10, 4), seed=1)  # 3 experts, 10 rows of 4 blocks (128 inputs)
    ours = mxfp4.dequantize(blocks, scales, dtype, "w")
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, rows]: transposed for its matmul
    assert ours.shape == (3, 10, 128) and ours.dtype == dtype
    assert torch.equal(ours, theirs.transpose(1, 2))


def test_value_order_within_a_byte_and_the_scale() -> None:
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x92  # low nibble 2 (+1.0): value 0; high nibble 9 (-0.5): value 1
    scales = torch.full((1, 1), 129, dtype=torch.uint8)  # 2^2
    out = mxfp4.dequantize(blocks, scales, torch.float32, "w")
    assert out[0, :2].tolist() == [4.0, -2.0] and not out[0, 2:].any()


def test_malformed_tensors_are_refused_by_name() -> None:
    blocks, scales = random_mxfp4((2, 3), seed=2)
    with pytest.raises(ExportError, match="experts.down_proj: MXFP4 blocks and scales must be uint8, got torch.int16"):
        mxfp4.dequantize(blocks.to(torch.int16), scales, torch.float32, "experts.down_proj")
    with pytest.raises(ExportError, match=r"must be \[\.\.\., G, 16\] beside scales \[\.\.\., G\]"):
        mxfp4.dequantize(blocks[..., :8], scales, torch.float32, "w")
    with pytest.raises(ExportError, match="beside scales"):
        mxfp4.dequantize(blocks, scales[:, :2], torch.float32, "w")
