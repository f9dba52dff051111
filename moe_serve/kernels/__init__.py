"""Compute kernels behind one small interface, each with two implementations:

- `cpu`: the C++ extension in csrc/ (AVX-512, built on first use with the machine's compiler and cached by
  torch under ~/.cache/torch_extensions): fp32 activations, fp32 or bf16 weights;
- `torch`: plain PyTorch, for CUDA, other dtypes, machines without AVX-512 or a compiler, and as the
  obviously correct reference the tests compare the fast path with.

`MOE_SERVE_KERNELS=torch` forces the torch implementations.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_extension: ModuleType | None = None
_tried = False


def cpu_extension() -> ModuleType | None:
    """The compiled CPU kernels, or None where they cannot be built (the reason is logged once)."""
    global _extension, _tried
    with _lock:
        if _tried:
            return _extension
        _tried = True
        if os.environ.get("MOE_SERVE_KERNELS", "auto") == "torch":
            return None
        if not _cpu_supports_avx512():
            logger.warning("CPU kernels need AVX-512; using the torch implementations")
            return None
        try:
            from torch.utils.cpp_extension import load

            source = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
            logger.info("building the CPU kernels (first use only; cached afterwards)")
            _extension = load(
                name="moe_serve_cpu_kernels",
                sources=[str(source)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as exc:  # no compiler, no headers: the torch implementations still serve
            logger.warning("could not build the CPU kernels (%s); using the torch implementations", exc)
            _extension = None
        return _extension


def _cpu_supports_avx512() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512f " in flags and " avx512bw " in flags and " avx512vl " in flags
