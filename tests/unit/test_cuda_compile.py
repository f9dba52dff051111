"""Every kernel configuration of the CUDA kernels (each module's SM90_SPECS) compiles for sm_90 (H100)
without a GPU, and fits the H100's shared memory. A module joins by adding its name to MODULES; one that
does not import yet (or without Triton) is skipped."""

from __future__ import annotations

import importlib
import os

import pytest

MODULES = ["moe_serve.kernels.cuda.moe", "moe_serve.kernels.cuda.attention", "moe_serve.kernels.cuda.norm"]
H100_SHARED_MEMORY = 232448  # bytes a block may use: 227 KiB

pytestmark = [
    # Under the interpreter @triton.jit gives an interpreted function, which triton.compile cannot take.
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles; not under the interpreter"),
    pytest.mark.slow,  # about 0.5 s per configuration on a cold Triton cache
]


def specs() -> list:
    params = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as error:  # not written yet, or no Triton
            params.append(
                pytest.param(None, id=name, marks=pytest.mark.skip(reason=f"{name} does not import: {error}"))
            )
            continue
        params += [pytest.param(spec, id=spec.name) for spec in module.SM90_SPECS]
    return params


@pytest.mark.parametrize("spec", specs())
def test_compiles_for_sm90(spec) -> None:
    triton = pytest.importorskip("triton")
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
