"""The plugin against vLLM's GPU build (0.33), installed without its CUDA parts beside the CPU torch
(`make test-vllm-gpu`, .venv-vllm-gpu): its classes run on CPU tensors with VLLM_TARGET_DEVICE=cpu. Skipped
where that build is not installed (the CPU build's tests are tests/vllm, in .venv-bench)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm.v1.worker.gpu.model_states", reason="vLLM's GPU build (make test-vllm-gpu)")

if os.environ.get("VLLM_TARGET_DEVICE") != "cpu" or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by make test-vllm-gpu (VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1)", allow_module_level=True)


@pytest.fixture(autouse=True, scope="session")
def staged_writes_on_cpu() -> None:
    """vLLM's StagedWriteTensor on CPU tensors: without a GPU, vLLM stands a placeholder in for Triton and
    takes the pinned-memory (UVA) path; here its buffers are plain ones and its kernel runs under Triton's
    interpreter (the same kernel the GPU runs)."""
    import triton
    from vllm.v1.worker.gpu import buffer_utils

    from tests.triton_interpreter import patch

    patch()
    buffer_utils.is_uva_available = lambda: False
    buffer_utils.triton, buffer_utils.tl = triton, triton.language
    for name in ("_apply_write_kernel", "_load_ptr"):
        kernel = getattr(buffer_utils, name)
        if not isinstance(kernel, triton.runtime.JITFunction | triton.runtime.interpreter.InterpretedFunction):
            setattr(buffer_utils, name, triton.jit(kernel))
