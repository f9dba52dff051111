"""Compute kernels behind one small interface, each with two implementations:

- `cpu`: the C++ extension in csrc/ (AVX-512, or AVX2 with FMA and F16C; built on first use with the machine's
  compiler and cached under ~/.cache/moe-serve/kernels, or `$MOE_SERVE_KERNEL_CACHE`): fp32 activations,
  fp32, bf16, int8 or int4 weights (packed.py);
- `torch`: plain PyTorch, for CUDA, other dtypes, machines with neither or without a compiler, and as the
  obviously correct reference the tests compare the fast path with.

`MOE_SERVE_KERNELS=torch` forces the torch implementations; `MOE_SERVE_KERNEL_ISA=avx2` builds the AVX2
variant on a CPU with AVX-512 too (the tests cover both builds that way). `python -m moe_serve.kernels`
builds the extension ahead of time (`make install` does).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

NAME = "moe_serve_cpu_kernels"
CSRC = Path(__file__).parent / "csrc"  # the C++ sources: the .cpp files compiled, the .h files they include
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_extension: ModuleType | None = None
_tried = False


def cpu_extension() -> ModuleType | None:
    """The compiled CPU kernels, or None where they cannot be built (the reason is logged once)."""
    global _extension, _tried
    if _tried:  # the hot path: no lock once decided
        return _extension
    with _lock:
        if _tried:
            return _extension
        _tried = True
        if torch_forced():
            return None
        if not cpu_supports_kernels():
            logger.warning("CPU kernels need AVX-512 or AVX2 with FMA and F16C; using the torch implementations")
            return None
        try:
            _extension = _load_or_build()
        except Exception as exc:  # no compiler, no headers: the torch implementations still serve
            logger.warning("could not build the CPU kernels (%s); using the torch implementations", exc)
            _extension = None
        return _extension


def torch_forced() -> bool:
    """MOE_SERVE_KERNELS=torch: the plain-torch implementations everywhere (CPU and CUDA)."""
    return os.environ.get("MOE_SERVE_KERNELS", "auto") == "torch"


def _avx2_forced() -> bool:
    return os.environ.get("MOE_SERVE_KERNEL_ISA") == "avx2"


def cflags() -> tuple[str, ...]:
    """-march=native: AVX-512 where the CPU has it, else AVX2; MOE_SERVE_KERNEL_ISA=avx2 forces AVX2."""
    return CFLAGS + ("-mno-avx512f",) if _avx2_forced() else CFLAGS


def source_files(directory: Path = CSRC) -> list[Path]:
    """Every C++ file of the extension in `directory` (not its subfolders): the .cpp files the build compiles
    and the .h files they include, sorted by name so that the key and the build see them in one order."""
    return sorted((p for p in directory.iterdir() if p.suffix in (".cpp", ".h") and p.is_file()), key=lambda p: p.name)


def compiled_sources(directory: Path = CSRC) -> list[Path]:
    """The translation units: the .cpp files of source_files, in its order."""
    return [p for p in source_files(directory) if p.suffix == ".cpp"]


def cache_dir(source_dir: Path = CSRC) -> Path:
    """Where this exact build lives: keyed by every source and header (names and contents), the flags,
    torch, Python and the machine, so a changed kernel or a different interpreter never loads a stale
    library. `source_dir`: the C++ sources to key (csrc/; another folder for the tests)."""
    root = Path(os.environ.get("MOE_SERVE_KERNEL_CACHE") or Path.home() / ".cache" / "moe-serve" / "kernels")
    import torch

    key = hashlib.sha256()
    for path in source_files(source_dir):  # each file's name and length first: no two layouts hash alike
        data = path.read_bytes()
        key.update(f"{path.name} {len(data)}\n".encode())
        key.update(data)
    for part in (repr((cflags(), LDFLAGS)).encode(), torch.__version__.encode()):
        key.update(part)
    key.update(f"{sys.version_info[:2]} {platform.machine()} {cpu_flags()}".encode())
    return root / key.hexdigest()[:16]


def _load_or_build() -> ModuleType:
    """Loads the cached library, building it first when missing. Builders serialise on an flock, which
    the kernel releases when a process dies: a build killed halfway (a test timeout, Ctrl-C) never leaves
    a lock behind that makes every later process wait forever, as torch's own lock file does. The library
    is moved into place only when complete, so a reader never loads a half-written file."""
    directory = cache_dir()
    library = directory / f"{NAME}.so"
    if not library.exists():
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / "build.lock", "w") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)  # another process may be building: wait for it
            if not library.exists():
                _build(directory, library)
    return _import(library)


def _build(directory: Path, library: Path) -> None:
    from torch.utils.cpp_extension import load

    logger.warning("building the CPU kernels (first use only, about a minute; cached in %s)", directory)
    scratch = directory / "build"
    shutil.rmtree(scratch, ignore_errors=True)  # whatever a killed build left, torch's lock file included
    scratch.mkdir()
    load(
        name=NAME,
        sources=[str(path) for path in compiled_sources()],
        extra_cflags=list(cflags()),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(scratch),
        verbose=False,
    )
    os.replace(scratch / f"{NAME}.so", library)
    shutil.rmtree(scratch, ignore_errors=True)


def _import(library: Path) -> ModuleType:
    import torch  # noqa: F401  (the library links against torch's, which must be loaded first)

    spec = importlib.util.spec_from_file_location(NAME, library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_flags() -> str:
    """The first CPU's feature flags line (`-march=native` compiles for exactly these), or "" off Linux."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def target_isa() -> str | None:
    """The vector instructions csrc/ compiles for here (its #if; `isa()` of the build): avx512 with
    AVX-512 F/BW/VL (unless MOE_SERVE_KERNEL_ISA=avx2), avx2 with AVX2, FMA and F16C (the fp16 scales of packed
    weights), else None."""
    flags = set(cpu_flags().split())
    if {"avx512f", "avx512bw", "avx512vl"} <= flags and not _avx2_forced():
        return "avx512"
    return "avx2" if {"avx2", "fma", "f16c"} <= flags else None


def has_bf16_dot() -> bool:
    """Whether the CPU kernels have bf16 dot products (--cpu-activations bf16: AVX-512 BF16, csrc/bf16_dot.h)."""
    ext = cpu_extension()
    return ext is not None and bool(ext.has_bf16_dot())


def cpu_supports_kernels() -> bool:
    return target_isa() is not None
