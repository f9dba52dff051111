"""The Triton kernels under Triton's interpreter (TRITON_INTERPRET=1: tests/conftest.py collects them only then),
with the interpreter's NumPy 2.4 fix (tests/triton_interpreter.py)."""

from __future__ import annotations

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.triton_interpreter import patch

    patch()
