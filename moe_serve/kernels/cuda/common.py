"""What every Triton kernel module shares: whether Triton can run here, whether it is interpreting (the CPU
tests), and the description of a configuration to build ahead of time for sm_90. Kept apart from the
package's `kernels()`, which imports the kernel modules, so that they can import this without a cycle."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

from moe_serve.kernels import torch_forced


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None and not torch_forced()


def interpreting() -> bool:
    """Under Triton's interpreter the kernels run on CPU tensors (the tests' way to check them)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class CompileSpec:
    """One kernel configuration to build ahead of time: `triton.compile(ASTSource(kernel, signature,
    constexprs), target=GPUTarget("cuda", 90, 32))` (tests/unit/kernels/cuda/test_cuda_compile.py)."""

    name: str
    kernel: Any  # the @triton.jit function
    signature: dict[str, str]  # argument -> "*bf16", "*fp32", "*i32", "*i64", "i32", "fp32", "constexpr"
    constexprs: dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3
