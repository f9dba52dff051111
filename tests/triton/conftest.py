"""The Triton kernels under Triton's interpreter (TRITON_INTERPRET=1: tests/conftest.py collects them only then).

Triton 3.6's interpreter turns a scalar into an int (a loop bound: `range(0, n, BLOCK)` over a kernel
argument or a loaded length) with int() on its one-element array, which NumPy 2.4 refuses (triton#9171,
fixed upstream by squeezing first). Until a Triton release carries the fix, the same squeeze is added here,
for every launch: the interpreter re-applies its patches around each one, so this wraps the function that
makes them.
"""

from __future__ import annotations

import os
from typing import Any

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton.runtime import interpreter

    _patch_lang_tensor = interpreter._patch_lang_tensor

    def _squeezing_index(tensor: Any, scope: Any) -> None:
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    if getattr(_patch_lang_tensor, "__name__", "") != "_squeezing_index":
        interpreter._patch_lang_tensor = _squeezing_index
