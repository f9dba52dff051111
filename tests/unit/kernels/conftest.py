"""What the CPU kernels' tests share."""

from __future__ import annotations

from types import ModuleType

import pytest

from moe_serve.kernels import cpu_extension


@pytest.fixture(scope="module")
def ext() -> ModuleType:
    """The built CPU kernels (the tests that take them are skipped where they do not build)."""
    native = cpu_extension()
    if native is None:
        pytest.skip("the CPU kernels are not built here")
    return native
