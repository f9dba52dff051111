"""Every kernel configuration of the CUDA kernels (each module's SM90_SPECS) compiles for sm_90 (H100)
without a GPU, and fits the H100's shared memory. A module joins by adding its name to MODULES."""

from __future__ import annotations

import importlib
import os

import pytest
import triton

MODULES = [
    "moe_serve.kernels.cuda.moe",
    "moe_serve.kernels.cuda.attention",
    "moe_serve.kernels.cuda.norm",
    "moe_serve.kernels.cuda.routing",
]
H100_SHARED_MEMORY = 232448  # bytes a block may use: 227 KiB

pytestmark = [
    # Under the interpreter @triton.jit gives an interpreted function, which triton.compile cannot take.
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles; not under the interpreter"),
    pytest.mark.slow,  # about 0.5 s per configuration on a cold Triton cache
]


def specs() -> list:
    return [pytest.param(spec, id=spec.name) for name in MODULES for spec in importlib.import_module(name).SM90_SPECS]


@pytest.mark.parametrize("spec", specs())
def test_compiles_for_sm90(spec) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # As the JIT specializes a torch tensor (whose storage is 16-byte aligned): without it, loads cannot be
    # vectorized or pipelined, and the shared memory measured would be the unpipelined kernel's.
    aligned = {
        (spec.kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in spec.signature.items() if t[0] == "*"
    }
    source = ASTSource(spec.kernel, signature=spec.signature, constexprs=spec.constexprs, attrs=aligned)
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert kernel.metadata.shared <= H100_SHARED_MEMORY, f"{spec.name}: {kernel.metadata.shared} bytes of shared memory"
