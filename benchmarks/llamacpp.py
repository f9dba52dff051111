"""llama.cpp for the side-by-side benchmark: built once from the llama-cpp-python sdist (it vendors llama.cpp,
its converter and gguf-py, and carries the ctypes bindings of that very llama.cpp), and the benchmark models
converted to GGUF. Everything is cached under the benchmark cache, keyed by the sdist's version:

    <cache>/llamacpp/<version>/   the sdist, its source tree, the cmake build (libllama.so, llama-quantize)
    <cache>/<model>/gguf-<version>/<type>.gguf

    python -m benchmarks.llamacpp [--models tiny,medium] [--types f32,bf16,q8_0,q4_0] [--cache DIR]

builds (about 5 minutes and 340 MB on 2 cores the first time) and converts what is missing.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tarfile
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.models import DEFAULT_CACHE, BenchModel, build

# The one pin: the sdist's vendored llama.cpp, its converter and its Python bindings all follow it.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"

# -DGGML_NATIVE: the kernels this CPU has (AVX2 or AVX-512), as moe-serve's own build does. Shared libraries:
# the engine drives libllama through llama-cpp-python's ctypes bindings. Only what the benchmark uses is built
# (no server, tests, examples or web UI), and no curl: everything stays offline.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
)
# libllama (the engine), llama-quantize (Q4_0, which the converter cannot write) and llama-batched-bench (a
# cross-check of the engine's figures with llama.cpp's own multi-sequence benchmark).
TARGETS = ("llama", "llama-quantize", "llama-batched-bench")

# GGUF weight types: the converter writes the first three itself (every matrix in that type; the router and the
# norms stay f32, as in moe-serve); q4_0 is quantized from f32 by llama-quantize, with --pure so that every
# matrix is Q4_0 (its default recipe keeps some of them, here attn_v, in Q8_0; moe-serve's int4 packs them all).
CONVERTER_TYPES = ("f32", "bf16", "q8_0")
QUANTIZED_TYPES = {"q4_0": ("f32", "Q4_0")}
GGUF_TYPES = (*CONVERTER_TYPES, *QUANTIZED_TYPES)


@dataclass(frozen=True, slots=True)
class LlamaCpp:
    """One version's cached tree."""

    root: Path  # <cache>/llamacpp/<version>
    version: str = LLAMA_CPP_PYTHON_VERSION

    @property
    def source(self) -> Path:  # the extracted sdist
        return self.root / f"llama_cpp_python-{self.version}"

    @property
    def vendor(self) -> Path:  # llama.cpp itself
        return self.source / "vendor" / "llama.cpp"

    @property
    def bin(self) -> Path:  # llama.cpp puts its executables and shared libraries here
        return self.root / "build" / "bin"

    @property
    def stamp(self) -> Path:  # written last: a build that was interrupted is redone
        return self.root / ".built"

    def tool(self, name: str) -> Path:
        return self.bin / name

    def built(self) -> bool:
        return self.stamp.is_file() and (self.bin / "libllama.so").is_file() and self.tool("llama-quantize").is_file()


def tree(cache: Path) -> LlamaCpp:
    return LlamaCpp(cache / "llamacpp" / LLAMA_CPP_PYTHON_VERSION)


def ensure_built(cache: Path, jobs: int = 2) -> LlamaCpp:
    """The cached build, made when missing (the sdist fetched with pip, configured and compiled with cmake)."""
    lcpp = tree(cache)
    if lcpp.built():
        return lcpp
    check_toolchain()
    lcpp.root.mkdir(parents=True, exist_ok=True)
    if not lcpp.vendor.is_dir():
        extract(fetch_sdist(lcpp.root), lcpp.root)
    build_dir = lcpp.root / "build"
    run(["cmake", "-S", str(lcpp.vendor), "-B", str(build_dir), *CMAKE_OPTIONS])
    run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TARGETS])
    lcpp.stamp.write_text(LLAMA_CPP_PYTHON_VERSION + "\n")
    return lcpp


def check_toolchain() -> None:
    """A clear error before a long build fails half-way."""
    tools = ("cmake", os.environ.get("CC", "cc"), os.environ.get("CXX", "c++"))
    missing = [tool for tool in tools if not shutil.which(tool)]
    if missing:
        raise SystemExit(
            f"building llama.cpp needs cmake and a C/C++ compiler; missing: {', '.join(missing)} "
            "(Debian: apt-get install cmake g++)"
        )


def fetch_sdist(dest: Path) -> Path:
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not (dest / name).is_file():
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", "-d", str(dest)]
        run([*pip, f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"])
    return dest / name


def extract(sdist: Path, dest: Path) -> None:
    with tarfile.open(sdist) as archive:
        archive.extractall(dest, filter="data")


def run(command: list[str], quiet: bool = False, **kwargs: object) -> None:
    """The command, echoed; quiet: its output (a converter's per-tensor log) shown only when it fails."""
    print("+ " + " ".join(command), flush=True)
    done = subprocess.run(command, capture_output=quiet, text=True, **kwargs)  # type: ignore[call-overload]
    if done.returncode != 0:
        if quiet:
            print(done.stdout[-4000:] + done.stderr[-4000:], file=sys.stderr)
        raise subprocess.CalledProcessError(done.returncode, command)


def bindings(lcpp: LlamaCpp) -> types.ModuleType:
    """llama-cpp-python's ctypes bindings (llama_cpp.llama_cpp) on the cached libllama. The package's __init__
    imports its high-level Llama class and that class's requirements (diskcache, jinja2), which the benchmark
    does not use, so the package is registered without running it; the bindings module loads the library
    named by LLAMA_CPP_LIB_PATH."""
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lcpp.bin)
    if "llama_cpp" not in sys.modules:
        package = types.ModuleType("llama_cpp")
        package.__path__ = [str(lcpp.source / "llama_cpp")]
        sys.modules["llama_cpp"] = package
    import llama_cpp.llama_cpp as api  # type: ignore[import-not-found]

    return api


def gguf_path(model: BenchModel, gguf_type: str) -> Path:
    return model.hf_dir.parent / f"gguf-{LLAMA_CPP_PYTHON_VERSION}" / f"{gguf_type}.gguf"


def ensure_gguf(model: BenchModel, gguf_type: str) -> Path:
    """The model's weights as GGUF of this type (f32, bf16, q8_0, q4_0), converted when missing."""
    out = gguf_path(model, gguf_type)
    if out.is_file():
        return out
    lcpp = ensure_built(model.cache)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")  # renamed when complete: an interrupted conversion is redone
    if gguf_type in CONVERTER_TYPES:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(lcpp.vendor / "gguf-py"), str(lcpp.vendor)]))
        convert = [sys.executable, "-m", "benchmarks.llamacpp_convert", str(model.hf_dir)]
        out_args = ["--outtype", gguf_type, "--outfile", str(partial)]
        run([*convert, *out_args], quiet=True, env=env, cwd=Path(__file__).resolve().parent.parent)
    else:
        source, quant = QUANTIZED_TYPES[gguf_type]
        quantize = [str(lcpp.tool("llama-quantize")), "--pure"]  # --pure: no tensor kept in a wider type
        run([*quantize, str(ensure_gguf(model, source)), str(partial), quant, "2"], quiet=True)
    partial.rename(out)
    return out


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """How the benchmark runs llama.cpp. The KV cache is fp32 (llama.cpp's default is f16), as moe-serve's is in
    every weight format (its packed weights are read with fp32 activations); flash attention is off, since its
    CPU path computes attention in 16-bit."""

    k: int  # experts per token: llama.cpp reads it once, at load (<arch>.expert_used_count)
    max_batch: int  # sequences decoded together
    max_len: int  # prompt plus generated tokens, per sequence
    threads: int = 2
    kv_type: int = 0  # GGML_TYPE_F32


class LlamaCppGenerator:
    """Greedy generation of many independent sequences through llama.cpp's C API: one multi-sequence
    llama_batch per step (sequence i has seq id i and its own KV stream), the argmax of each sequence's logits
    taken here. Prompts are token ids; no BOS is added and EOS is ignored, as in the other engines."""

    def __init__(self, lcpp: LlamaCpp, gguf_file: Path, settings: EngineSettings) -> None:
        api = self.api = bindings(lcpp)
        self._log = api.llama_log_callback(_errors_only)  # kept alive here: C holds only the pointer
        api.llama_log_set(self._log, None)
        api.llama_backend_init()
        self.settings = settings
        self.model = self._load(gguf_file, settings.k)
        self.n_vocab = api.llama_vocab_n_tokens(api.llama_model_get_vocab(self.model))
        params = api.llama_context_default_params()
        params.n_ctx = settings.max_batch * settings.max_len
        params.n_batch = params.n_ctx  # a whole prefill (every prompt of the batch) in one llama_decode
        params.n_seq_max = settings.max_batch
        params.n_threads = params.n_threads_batch = settings.threads
        params.flash_attn_type = api.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.type_k = params.type_v = settings.kv_type
        params.no_perf = True
        self.ctx = api.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {gguf_file}")
        if api.llama_n_ctx_seq(self.ctx) < settings.max_len:
            raise RuntimeError(f"llama.cpp gave {api.llama_n_ctx_seq(self.ctx)} positions per sequence")

    def _load(self, gguf_file: Path, k: int):  # noqa: ANN202
        """The model with <arch>.expert_used_count overridden to k. The architecture's name (llama, for a
        Mixtral checkpoint) and its expert count are read first from a vocabulary-only load: llama.cpp aborts
        the process on a k above the expert count."""
        api = self.api
        params = api.llama_model_default_params()
        params.vocab_only = True
        probe = api.llama_model_load_from_file(str(gguf_file).encode(), params)
        if not probe:
            raise RuntimeError(f"llama.cpp could not read {gguf_file}")
        arch, experts = ctypes.create_string_buffer(128), ctypes.create_string_buffer(32)
        api.llama_model_meta_val_str(probe, b"general.architecture", arch, len(arch))
        api.llama_model_meta_val_str(probe, arch.value + b".expert_count", experts, len(experts))
        api.llama_model_free(probe)
        if not 1 <= k <= int(experts.value or 0):
            raise ValueError(f"k={k}: {gguf_file} has {experts.value.decode() or 'no'} experts")
        self._overrides = (api.llama_model_kv_override * 2)()  # kept alive with the model; an empty key ends it
        self._overrides[0].key = arch.value + b".expert_used_count"
        self._overrides[0].tag = api.LLAMA_KV_OVERRIDE_TYPE_INT
        self._overrides[0].value.val_i64 = k
        params = api.llama_model_default_params()
        params.kv_overrides = self._overrides
        # Read into memory at load, as the other engines' weights are: mapped, the first steps to touch an
        # expert would page it in from disk, inside the timing (seconds for medium's F32 file on this VM).
        params.load_mode = api.LLAMA_LOAD_MODE_NONE
        model = api.llama_model_load_from_file(str(gguf_file).encode(), params)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {gguf_file} at k={k}")
        return model

    def generate(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
        """new_tokens greedy tokens after each prompt (all of one length); the KV cache starts empty."""
        import numpy as np

        batch, prompt_len = len(prompts), len(prompts[0])
        assert batch <= self.settings.max_batch and prompt_len + new_tokens <= self.settings.max_len
        self.api.llama_memory_clear(self.api.llama_get_memory(self.ctx), True)
        rows = np.arange(batch * prompt_len)
        prefill = _Batch(self.api, seqs=rows // prompt_len, outputs=rows % prompt_len == prompt_len - 1)
        decode = _Batch(self.api, seqs=np.arange(batch), outputs=np.ones(batch, dtype=bool))
        try:
            out = [self._step(prefill, np.asarray(prompts).reshape(-1), rows % prompt_len)]
            for position in range(prompt_len, prompt_len + new_tokens - 1):
                out.append(self._step(decode, out[-1], position))
        finally:
            prefill.free()
            decode.free()
        return np.stack(out, axis=1).tolist()

    def log_probs(self, tokens: Sequence[int]):  # noqa: ANN201
        """Log-softmax of the logits at every position of one sequence, in one llama_decode (the parity check
        compares them with moe-serve's logprobs of the tokens it generated)."""
        import numpy as np

        assert len(tokens) <= self.settings.max_len
        self.api.llama_memory_clear(self.api.llama_get_memory(self.ctx), True)
        batch = _Batch(self.api, seqs=np.zeros(len(tokens), dtype=int), outputs=np.ones(len(tokens), dtype=bool))
        try:
            logits = self._logits(batch, tokens, np.arange(len(tokens))).astype(np.float64)
        finally:
            batch.free()
        shifted = logits - logits.max(axis=1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))

    def _step(self, batch: _Batch, tokens, positions):  # noqa: ANN001, ANN202
        """One llama_decode; the argmax of each output row's logits (one row per sequence)."""
        return self._logits(batch, tokens, positions).argmax(axis=1)

    def _logits(self, batch: _Batch, tokens, positions):  # noqa: ANN001, ANN202
        """One llama_decode; the logits of the rows flagged as outputs, a view valid until the next decode."""
        import numpy as np

        batch.token[:] = tokens
        batch.pos[:] = positions
        if self.api.llama_decode(self.ctx, batch.raw) != 0:
            raise RuntimeError("llama_decode failed")
        return np.ctypeslib.as_array(self.api.llama_get_logits(self.ctx), shape=(batch.n_outputs, self.n_vocab))

    def close(self) -> None:
        self.api.llama_free(self.ctx)
        self.api.llama_model_free(self.model)


def _errors_only(level: int, text: bytes, user_data: object) -> None:
    """llama.cpp's log: its errors (why a load failed) on stderr, not the rest (every tensor it loads)."""
    if level == 4:  # GGML_LOG_LEVEL_ERROR in ggml.h (the bindings' comment numbers the levels differently)
        sys.stderr.write(text.decode(errors="replace"))


class _Batch:
    """A llama_batch whose rows keep their sequence ids and output flags from step to step; token and pos
    are numpy views written in place."""

    def __init__(self, api: types.ModuleType, seqs, outputs) -> None:  # noqa: ANN001
        import numpy as np

        n = len(seqs)
        self.api, self.raw, self.n_outputs = api, api.llama_batch_init(n, 0, 1), int(outputs.sum())
        self.raw.n_tokens = n
        self.token = np.ctypeslib.as_array(self.raw.token, shape=(n,))
        self.pos = np.ctypeslib.as_array(self.raw.pos, shape=(n,))
        np.ctypeslib.as_array(self.raw.n_seq_id, shape=(n,))[:] = 1
        np.ctypeslib.as_array(self.raw.logits, shape=(n,))[:] = outputs
        for i, seq in enumerate(seqs.tolist()):
            self.raw.seq_id[i][0] = seq

    def free(self) -> None:
        self.api.llama_batch_free(self.raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,medium")
    parser.add_argument("--types", default=",".join(GGUF_TYPES))
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--build-only", action="store_true")
    args = parser.parse_args()
    lcpp = ensure_built(args.cache)
    print(f"llama.cpp {lcpp.version}: {lcpp.bin}")
    if args.build_only:
        return
    for name in filter(None, args.models.split(",")):
        model = build(name, args.cache)
        for gguf_type in args.types.split(","):
            print(f"{name} {gguf_type}: {ensure_gguf(model, gguf_type)}", flush=True)


if __name__ == "__main__":
    main()
