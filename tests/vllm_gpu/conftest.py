"""The plugin against vLLM's GPU build (0.33), installed without its CUDA parts beside the CPU torch
(`make test-vllm-gpu`, .venv-vllm-gpu): its classes run on CPU tensors with VLLM_TARGET_DEVICE=cpu. Skipped
where that build is not installed, or not run as that target runs it (the vllm_gpu marker's check,
tests/conftest.py; the CPU build's tests are tests/vllm, in .venv-bench)."""

from __future__ import annotations

import pytest

from tests.conftest import skip_folder_without

# Its test module imports vLLM at its top: without it, it cannot be collected, let alone skipped test by test.
skip_folder_without("vllm_gpu")


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
