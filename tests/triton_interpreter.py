"""Triton 3.6's interpreter under NumPy 2.4: it turns a scalar into an int (a loop bound: `range(0, n, BLOCK)`
over a kernel argument or a loaded length) with int() on its one-element array, which NumPy 2.4 refuses
(triton#9171, fixed upstream by squeezing first). Until a Triton release carries the fix, `patch()` adds the
same squeeze for every launch: the interpreter re-applies its patches around each one, so this wraps the
function that makes them. Used by tests/triton and tests/vllm_gpu (both run under TRITON_INTERPRET=1).
"""

from __future__ import annotations

from typing import Any


def patch() -> None:
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "__name__", "") == "_squeezing_index":
        return

    def _squeezing_index(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    interpreter._patch_lang_tensor = _squeezing_index
