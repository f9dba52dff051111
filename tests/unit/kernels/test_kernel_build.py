"""Building the CPU kernels survives what CI and users do to it: a builder killed halfway (torch's own
lock file would then make every later process wait forever) and several processes starting at once; and a
changed source or header always builds a new library."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import moe_serve.kernels
from moe_serve.kernels import CSRC, cache_dir, compiled_sources, cpu_supports_kernels, source_files

builds = pytest.mark.skipif(not cpu_supports_kernels(), reason="the CPU kernels need AVX-512 or AVX2 + FMA")

LOAD = "from moe_serve.kernels import cpu_extension; assert cpu_extension() is not None; print('ok')"


def test_every_source_and_header_is_in_the_cache_key_and_the_build(tmp_path, monkeypatch):
    """The key hashes every .cpp and .h of csrc/, in sorted order: editing any one of them (or adding a
    header) gives a new cache directory, so no process loads a library built from the old headers; and the
    build compiles every .cpp, in that order."""
    monkeypatch.setenv("MOE_SERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    on_disk = sorted(p.name for p in CSRC.iterdir() if p.suffix in (".cpp", ".h"))
    assert [p.name for p in source_files()] == on_disk
    assert {p.suffix for p in source_files()} == {".cpp", ".h"}  # headers included, not only sources
    copy = tmp_path / "csrc"
    shutil.copytree(CSRC, copy)
    assert cache_dir(copy) == cache_dir()  # the contents count, not the folder they are in
    for name in on_disk:
        original = (copy / name).read_bytes()
        (copy / name).write_bytes(original + b"\n")
        assert cache_dir(copy) != cache_dir(), f"editing {name} kept the cache key"
        (copy / name).write_bytes(original)
    assert cache_dir(copy) == cache_dir()
    (copy / "extra.h").write_text("#pragma once\n")
    assert cache_dir(copy) != cache_dir()

    built: list[list[str]] = []

    def load(**kwargs):  # torch's builder, stubbed: which sources would it compile?
        built.append(kwargs["sources"])
        (Path(kwargs["build_directory"]) / f"{kwargs['name']}.so").write_bytes(b"")

    monkeypatch.setattr("torch.utils.cpp_extension.load", load)
    directory = tmp_path / "build"
    directory.mkdir()
    moe_serve.kernels._build(directory, directory / "library.so")
    assert built == [[str(p) for p in compiled_sources()]]
    assert [Path(p).name for p in built[0]] == [name for name in on_disk if name.endswith(".cpp")]


@pytest.mark.slow
@builds
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


@pytest.mark.slow
@builds
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
