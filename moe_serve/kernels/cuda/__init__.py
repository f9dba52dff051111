"""The CUDA kernels: Triton programs for the ops in moe_serve.kernels.ops (MoE experts and their
routing, paged attention, norms, rotary plus cache write), dispatched there for CUDA tensors as the C++
kernels are for CPU ones.

Nothing here syncs with the host: every shape a launch needs is static (the artifact's max k, the batch's
token count), and what varies per row (its k, its sequence length) is read on the device.

Triton is optional: without it (or with MOE_SERVE_KERNELS=torch) CUDA takes the plain-torch twins in ops.
The CPU test suite runs these kernels under Triton's interpreter (TRITON_INTERPRET=1, tests/triton) and
compiles every configuration in SM90_SPECS for sm_90 without a GPU (tests/unit/kernels/cuda/test_cuda_compile.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moe_serve.kernels.cuda.common import triton_available


@dataclass(frozen=True)
class Kernels:
    """The kernel modules, imported together on first use (Triton compiles each kernel at its first launch)."""

    moe: Any  # moe_serve.kernels.cuda.moe
    attention: Any  # moe_serve.kernels.cuda.attention
    norm: Any  # moe_serve.kernels.cuda.norm
    routing: Any  # moe_serve.kernels.cuda.routing


_kernels: Kernels | None = None
_decided = False


def kernels() -> Kernels | None:
    """The CUDA kernels, or None without Triton (or with MOE_SERVE_KERNELS=torch). Decided once: ops asks
    on every call."""
    global _kernels, _decided
    if not _decided:
        _decided = True
        if triton_available():
            from moe_serve.kernels.cuda import attention, moe, norm, routing

            _kernels = Kernels(moe, attention, norm, routing)
    return _kernels
