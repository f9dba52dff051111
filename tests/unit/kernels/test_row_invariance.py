"""The element-wise torch ops the layers use compute a token's values the same whatever else is in its tensor
(kernels.vocabulary.row_invariant): ATen's CPU loops for sigmoid, silu, tanh-gelu and log1p take a vectorised or a
scalar path by the tensor's size, which differ in the last bit, and a request's log-probabilities moved with its
batch (Llama 4's router and temperature, DeepSeek-V3's and GLM-4.5's routers, every dense FFN and shared expert
with SiLU). Each op here, over tensors of 1 to 40 rows of several widths, gives every row bitwise what the row
gives alone, and stays within one float32 rounding of torch's own."""

from __future__ import annotations

import pytest
import torch

from moe_serve.kernels.vocabulary import ACTIVATIONS, SwiGLUClamp, glu, log1p, sigmoid

SWIGLU = SwiGLUClamp(alpha=1.702, limit=7.0)
OPS = {
    "sigmoid": sigmoid,
    "log1p": lambda x: log1p(x.abs()),
    **{f"activation {name}": fn for name, fn in ACTIVATIONS.items()},
    "glu silu": lambda x: glu("silu", x, x.flip(-1)),
    "glu swigluoai": lambda x: glu("swigluoai", x, x.flip(-1), SWIGLU),
}
REFERENCE = {
    "sigmoid": torch.sigmoid,
    "log1p": lambda x: torch.log1p(x.abs()),
    "activation silu": torch.nn.functional.silu,
    "activation gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
}


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_what_it_is_alone(name: str, dtype: torch.dtype) -> None:
    fn = OPS[name]
    generator = torch.Generator().manual_seed(0)
    for width in (4, 8, 16, 80):
        for rows in (1, 2, 3, 8, 9, 17, 40):
            x = (torch.randn(rows, width, generator=generator) * 4).to(dtype)
            together = fn(x)
            for r in range(rows):
                assert torch.equal(together[r], fn(x[r : r + 1])[0]), (name, width, rows, r)


@pytest.mark.parametrize("name", list(REFERENCE))
def test_within_one_rounding_of_torch(name: str) -> None:
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(1)) * 4
    torch.testing.assert_close(OPS[name](x), REFERENCE[name](x), atol=1e-6, rtol=2**-23)
