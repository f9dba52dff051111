"""Building the CPU kernels survives what CI and users do to it: a builder killed halfway (torch's own
lock file would then make every later process wait forever) and several processes starting at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_serve.kernels import cache_dir, cpu_supports_kernels

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not cpu_supports_kernels(), reason="the CPU kernels need AVX-512 or AVX2 + FMA"),
]

LOAD = "from moe_serve.kernels import cpu_extension; assert cpu_extension() is not None; print('ok')"


def test_a_killed_build_does_not_block_later_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_SERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("MOE_SERVE_KERNELS", raising=False)
    killed = subprocess.Popen([sys.executable, "-c", LOAD], stderr=subprocess.PIPE, start_new_session=True)
    directory = cache_dir()
    deadline = time.monotonic() + 60
    while not (directory / "build" / "lock").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (directory / "build" / "lock").exists(), "the first builder never started compiling"
    os.killpg(killed.pid, signal.SIGKILL)  # the compiler too, as a CI timeout would
    killed.wait(timeout=30)
    assert (directory / "build" / "lock").exists()  # torch's lock file is left behind

    racers = [
        subprocess.Popen([sys.executable, "-c", LOAD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [racer.communicate(timeout=400) for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0], outputs
    assert [out.strip() for out, _ in outputs] == ["ok", "ok"]
    assert sum("building the CPU kernels" in err for _, err in outputs) == 1  # one built, one waited
    assert sorted(p.name for p in directory.iterdir()) == ["build.lock", "moe_serve_cpu_kernels.so"]


def test_the_avx2_build_passes_the_kernel_tests(tmp_path):
    """Where the CPU has AVX-512 the AVX2 variant is otherwise never built: build it and run the kernel
    tests against it (on an AVX2-only CPU this repeats the native build)."""
    env = {**os.environ, "MOE_SERVE_KERNEL_CACHE": str(tmp_path), "MOE_SERVE_KERNEL_ISA": "avx2"}
    env.pop("MOE_SERVE_KERNELS", None)
    tests = Path(__file__).parent / "test_cpu_kernels.py"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
