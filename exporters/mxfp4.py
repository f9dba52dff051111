"""MXFP4 weights (OCP Microscaling, as gpt-oss checkpoints ship their experts) -> float tensors.

A block of 32 values shares one scale 2^(e - 127), e a uint8 (E8M0); each value is FP4 E2M1, two to a byte:
value 2i in byte i's low nibble, 2i + 1 in its high one. A checkpoint stores `<name>_blocks` [..., rows, G,
16] uint8 and `<name>_scales` [..., rows, G] uint8 for a weight [..., rows, G * 32].

moe-serve serves no MXFP4 kernel: an import dequantizes to the artifact's dtype, which costs memory: 4.25
bits a weight on disk (4 + 8 / 32 for the scale) against 16 in bf16 (3.8x) or 32 in fp32 (7.5x).
"""

from __future__ import annotations

import torch

from moe_serve.exporters.base import ExportError

BLOCK = 32
BITS_PER_WEIGHT = 4 + 8 / BLOCK
# E2M1: sign, two exponent bits, one mantissa bit (no infinities, no NaN).
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """blocks [..., rows, G, 16] uint8, scales [..., rows, G] uint8 -> [..., rows, G * 32] in `dtype` (exact:
    every E2M1 value times a power of two is representable in bf16 and fp32 for the exponents used)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ExportError(f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ExportError(
            f"{name}: MXFP4 blocks must be [..., G, {BLOCK // 2}] beside scales [..., G]; "
            f"got {tuple(blocks.shape)} and {tuple(scales.shape)}"
        )
    table = torch.tensor(FP4_E2M1, dtype=torch.float32)
    values = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2)  # [..., G, 32]: value 2i from the low nibble, 2i + 1 from the high one
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).to(dtype)
