"""The one prepared device check for a lent GPU machine (docs/gpu.md), sized so that a run and a rerun fit in
one 15-minute lease:

    python3 -m benchmarks.gpu_check [--out DIR] [--budget-s 290]      (`make gpu-check`)

Phases, in order, sharing one wall-clock budget; each runs in its own process group under its own timeout, so
one hang cannot eat the others' time, and a phase that cannot run is recorded as skipped with the reason:

1. setup (this process, standard library only): installs the wheels carried in `.whl/` (what moe-serve needs
   that the GPU image lacks: `make gpu-wheels`) into a private folder put on PYTHONPATH for every later phase,
   with `pip --no-index`; on a machine with nvidia-smi where `moe_serve.exporters` is not importable (the
   image, where the repository is a bare copy), `pip install --no-index --no-deps --no-build-isolation -e .`;
2. probe: versions, the device, its multiprocessors and free memory, which modules import;
3. tests: `pytest -m gpu --maxfail=10` over the test files that mention the gpu mark (log and junit xml in OUT);
4. bench, one process per model (the large first): random bf16 Mixtral-format weights built on the GPU with
   transformers' own class, converted in memory by exporters.hf into a moe-serve model; decode tokens/s at
   batch 1, 16, 64 x k = 1, 2, N, mixed x CUDA graphs / eager; prefill tokens/s on 512-token prompts;
   transformers `generate` on the same weights; the device's copy bandwidth and the batch-1 roofline fraction.

Writes OUT/gpu_check.json (every phase: status ok / failed / skipped / timeout, reason, seconds, figures),
OUT/gpu_check.md (the tables, also printed last), OUT/gpu_check.log (the workers' output), OUT/gpu_tests.log
and OUT/gpu_tests.xml. On a machine without CUDA the same command is a dry run: setup, probe, clean skips.
Nothing here raises out of `main`: the exit status is 0 unless this script itself is broken.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.models import PRESETS

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("setup", "probe", "tests", "bench-large", "bench-medium")

# The large model: Mixtral's shape scaled to ~3.55 B parameters (7.1 GB in bf16), built on the GPU in seconds.
LARGE = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=4096,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
    num_local_experts=8,
    num_experts_per_tok=2,
)
# tiny: only for checking this script on a CPU (--device cpu --quick).
MODELS: dict[str, dict[str, int]] = {"large": LARGE, "medium": PRESETS["medium"], "tiny": PRESETS["tiny"]}
GOALS = {"roofline_k2_batch1": 0.70, "hf_ratio": 3.0, "graph_speedup_batch1": 2.0}


# ---- configuration --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Budget:
    """Wall-clock seconds. The whole check must end inside 5 minutes on an H100 so that a rerun fits in the
    15-minute lease; the phases get caps, the benchmark gets what the others leave."""

    total_s: float = 290.0
    setup_s: float = 60.0  # the wheels and, on the image, the editable install of the repository
    probe_s: float = 45.0  # imports torch and initialises CUDA
    tests_s: float = 130.0  # pytest -m gpu, the CPU-kernel build that tests/conftest.py starts included
    bench_min_s: float = 60.0  # the tests stop this much before the end so that the benchmark still runs
    large_share: float = 0.6  # of the benchmark's time, for the large model (the goals are measured on it)
    report_s: float = 5.0  # kept for writing the report
    grace_s: float = 10.0  # a worker past its own deadline is killed this much later


@dataclass(frozen=True, slots=True)
class BenchSettings:
    """One model's measurements. Short runs (32 new tokens, two repetitions after a warm-up) so that both
    models, both runners and the transformers baseline fit in about 150 s."""

    batches: tuple[int, ...] = (1, 16, 64)
    prompt_len: int = 32
    new_tokens: int = 32
    warmup_tokens: int = 4  # at least three decode steps at the batch size: graphs captured, kernels compiled
    reps: int = 2
    prefill_len: int = 512
    prefill_prompts: int = 8
    parity_prompts: int = 4
    parity_tokens: int = 8
    seed: int = 0
    kv_cache_bytes: int = 4 << 30
    cell_floor_s: float = 3.0  # a cell starts only with this much time left before the deadline
    build_floor_s: float = 20.0


# The bench worker's path in seconds on a CPU (tests/bench/test_gpu_check.py): tiny runs, the same code.
QUICK = BenchSettings(
    batches=(1, 4),
    prompt_len=8,
    new_tokens=4,
    warmup_tokens=2,
    reps=1,
    prefill_len=16,
    prefill_prompts=2,
    parity_prompts=2,
    parity_tokens=4,
    kv_cache_bytes=16 << 20,
    cell_floor_s=0.0,
    build_floor_s=0.0,
)


@dataclass
class Phase:
    name: str
    status: str = "skipped"  # ok, failed, skipped, timeout
    reason: str = ""
    seconds: float = 0.0
    limit_s: float | None = None
    data: dict[str, Any] = field(default_factory=dict)


class Clock:
    """The shared budget: how much of it is left, and the limit a phase gets."""

    def __init__(self, total_s: float) -> None:
        self.start = time.monotonic()
        self.total_s = total_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.total_s - self.elapsed()


# ---- the roofline -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MoEShape:
    """The sizes of a Mixtral-format model (no biases, untied LM head, head_dim = hidden / heads)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    experts: int
    top_k: int

    @classmethod
    def of(cls, config: dict[str, int]) -> MoEShape:
        return cls(
            config["vocab_size"],
            config["hidden_size"],
            config["intermediate_size"],
            config["num_hidden_layers"],
            config["num_attention_heads"],
            config["num_key_value_heads"],
            config["num_local_experts"],
            config["num_experts_per_tok"],
        )

    def attention_params(self) -> int:
        head_dim = self.hidden // self.heads
        return 2 * self.hidden * self.heads * head_dim + 2 * self.hidden * self.kv_heads * head_dim  # q, o; k, v

    def expert_params(self) -> int:
        return 3 * self.hidden * self.intermediate  # gate, up, down

    def params(self) -> int:
        """Every parameter: embeddings, LM head and final norm, and per layer attention, two norms, router,
        all experts."""
        per_layer = self.attention_params() + 2 * self.hidden + self.experts * self.hidden
        per_layer += self.experts * self.expert_params()
        return 2 * self.vocab * self.hidden + self.hidden + self.layers * per_layer

    def decode_bytes(self, k: int, value_bytes: int = 2, router_bytes: int = 4) -> int:
        """Weight bytes one batch-1 decode step reads at k: per layer attention, two norms, the router (kept in
        fp32, docs/architecture.md §2) and k experts; one embedding row, the final norm and the LM head. The KV
        cache is left out (under 1% at these contexts)."""
        per_layer = value_bytes * (self.attention_params() + 2 * self.hidden + k * self.expert_params())
        per_layer += router_bytes * self.experts * self.hidden
        return self.layers * per_layer + value_bytes * (2 * self.hidden + self.vocab * self.hidden)


def k_values(shape: MoEShape) -> dict[str, list[int]]:
    """Label -> the k of each row (cycled over the batch): 1, the trained k, all experts, and a mix of the three."""
    return {"1": [1], "2": [2], "N": [shape.experts], "mixed": [1, 2, shape.experts]}


# ---- setup (standard library only) ------------------------------------------------------------------------------

_WHEEL = re.compile(r"^(?P<name>.+?)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$")


def wheel_fits(filename: str, version: tuple[int, int] = sys.version_info[:2], machine: str | None = None) -> bool:
    """Whether this interpreter can install the wheel: pure Python, or built for this CPython on Linux x86-64
    (the GPU image is CPython 3.12 there; a dry run here may be another version, and skips those wheels)."""
    match = _WHEEL.match(filename)
    if match is None:
        return False
    pythons, abis, plats = (set(match[part].split(".")) for part in ("py", "abi", "plat"))
    if "any" in plats:
        return bool(pythons & {"py3", f"py{version[0]}{version[1]}"}) or f"cp{version[0]}{version[1]}" in pythons
    machine = machine or os.uname().machine
    cpython = f"cp{version[0]}{version[1]}"
    on_linux = sys.platform == "linux" and any(machine in plat for plat in plats)
    return on_linux and cpython in pythons and bool(abis & {cpython, "abi3", "none"})


def install_wheels(wheel_dir: Path, site: Path, limit_s: float) -> dict[str, Any]:
    """The carried wheels that fit this interpreter, into `site` (put on PYTHONPATH for the later phases)."""
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    if not wheels:
        return {"status": "skipped", "reason": f"no wheels in {wheel_dir}"}
    fits = [w for w in wheels if wheel_fits(w.name)]
    info: dict[str, Any] = {
        "installed": [w.name for w in fits],
        "not_for_this_interpreter": [w.name for w in wheels if w not in fits],
        "site": str(site),
    }
    if not fits:
        return info | {"status": "skipped", "reason": "no carried wheel fits this interpreter"}
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    command += ["--no-cache-dir", "--upgrade", "--target", str(site), *map(str, fits)]
    done = run_quietly(command, limit_s)
    return info | done


def needs_editable_install(env: dict[str, str]) -> bool:
    """On the GPU image the repository is a bare copy: `moe_serve.exporters` (the exporters/ folder, mapped by
    pyproject.toml) imports only once the package is installed. Only there (nvidia-smi present) is the
    interpreter's environment changed; a dry run never installs anything outside the private folder."""
    if shutil.which("nvidia-smi") is None:
        return False
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('moe_serve.exporters') is None)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, timeout=30)
    return done.returncode != 0


def editable_install(limit_s: float) -> dict[str, Any]:
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation"]
    return run_quietly([*command, "-e", str(ROOT)], limit_s)


def run_quietly(command: list[str], limit_s: float) -> dict[str, Any]:
    """{"status", "seconds", "reason"} of a command that should just work (pip)."""
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=max(limit_s, 1.0))
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "seconds": time.monotonic() - start, "reason": f"over {limit_s:.0f} s"}
    status = "ok" if done.returncode == 0 else "failed"
    reason = "" if status == "ok" else tail(done.stderr or done.stdout, 6)
    return {"status": status, "seconds": round(time.monotonic() - start, 2), "reason": reason}


def setup(phase: Phase, args: argparse.Namespace, env: dict[str, str]) -> None:
    """Wheels first (the editable install needs nothing from them, but the probe does), then the repository."""
    wheels = install_wheels(args.wheels, args.site, phase.limit_s or 60.0)
    phase.data["wheels"] = wheels
    if wheels.get("status") == "ok":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.site), env.get("PYTHONPATH", "")]))
    if needs_editable_install(env):
        phase.data["editable_install"] = editable_install(phase.limit_s or 60.0)
    failed = [part for part in ("wheels", "editable_install") if phase.data.get(part, {}).get("status") == "failed"]
    phase.status = "failed" if failed else "ok"
    phase.reason = "; ".join(f"{part}: {phase.data[part]['reason']}" for part in failed)


def start_cpu_kernel_build(env: dict[str, str], log: Path) -> subprocess.Popen | None:
    """On the GPU machine, builds moe-serve's C++ CPU kernels in the background while the probe runs:
    tests/conftest.py builds them before any test (about a minute, once per bare machine) and waits on the
    same lock, so the tests phase pays only what is left of the build. Never on a dry run."""
    if shutil.which("nvidia-smi") is None:
        return None
    with open(log, "a") as out:  # the child keeps its own descriptor
        out.write("\n===== background: python -m moe_serve.kernels\n")
        out.flush()
        command = [sys.executable, "-m", "moe_serve.kernels"]
        return subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(proc: subprocess.Popen | None, phase: Phase) -> None:
    """Records how the background build ended; ends it (its process group, by id) if it still runs."""
    if proc is None:
        return
    code = proc.poll()
    if code is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    phase.data["cpu_kernel_build"] = "still running at the end: killed" if code is None else f"exit status {code}"


# ---- worker processes -------------------------------------------------------------------------------------------


def run_worker(
    phase: Phase, worker: list[str], env: dict[str, str], log: Path, scratch: Path, budget: Budget
) -> dict[str, Any]:
    """Runs `python -m benchmarks.gpu_check --worker ...` in its own process group under phase.limit_s; the
    worker writes its (partial) results to a file after each measurement, so a timeout keeps what it measured."""
    assert phase.limit_s is not None
    result = scratch / f"{phase.name}.json"
    deadline = time.time() + phase.limit_s - budget.grace_s
    command = [sys.executable, "-m", "benchmarks.gpu_check", *worker, "--result", str(result)]
    command += ["--deadline", f"{deadline:.3f}"]
    status, reason = run_logged(command, phase.limit_s, env, log, f"phase {phase.name}")
    data = json.loads(result.read_text()) if result.is_file() else {}
    phase.status, phase.reason = status, reason
    if status == "ok" and data.get("error"):
        phase.status, phase.reason = "failed", data["error"]
    return data


def run_logged(command: list[str], limit_s: float, env: dict[str, str], log: Path, title: str) -> tuple[str, str]:
    """(status, reason) of a command run with its output appended to `log`; killed with its process group
    (servers a test started included) when it outlives limit_s."""
    with open(log, "a") as out:
        out.write(f"\n===== {title}: {' '.join(command)}\n")
        out.flush()
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=max(limit_s, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timeout", f"killed after {limit_s:.0f} s"
    if code != 0:
        return "failed", f"exit status {code}: " + tail(log.read_text(errors="replace"), 4)
    return "ok", ""


def tail(text: str, lines: int) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


class Results:
    """A worker's results, rewritten (atomically) after each step so that the parent reads whatever was measured
    before a kill."""

    def __init__(self, path: Path, deadline: float) -> None:
        self.path = path
        self.deadline = deadline
        self.data: dict[str, Any] = {}

    def save(self) -> None:
        scratch = self.path.with_suffix(".tmp")
        scratch.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(scratch, self.path)

    def left(self) -> float:
        return self.deadline - time.time()

    def attempt(
        self, where: dict[str, Any], key: str, floor_s: float, fn: Callable[[], Any], label: str | None = None
    ) -> Any:
        """where[key] = fn()'s figures, or why there are none (skipped for time, or the error); saved either way,
        and a line printed (to gpu_check.log: where a slow or hung step shows). Returns fn()'s value, or None."""
        label = label or key
        if self.left() < floor_s:
            where[key] = {"skipped": f"time budget: {self.left():.0f} s left, {floor_s:.0f} s needed"}
            return self.record(label, where[key])
        start = time.monotonic()
        try:
            value = fn()
        except Exception as exc:  # recorded, and the next measurement runs
            where[key] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            return self.record(label, where[key])
        figures = value if isinstance(value, dict) else {}
        where[key] = {**figures, "wall_s": round(time.monotonic() - start, 2)}
        self.record(label, where[key])
        return value

    def record(self, label: str, entry: dict[str, Any]) -> None:
        self.save()
        print(f"{time.strftime('%H:%M:%S')} {label}: {json.dumps(entry, default=str)[:300]}", flush=True)


# ---- probe worker ----------------------------------------------------------------------------------------------

PROBE_VERSIONS = ("torch", "triton", "transformers", "safetensors", "tokenizers", "numpy", "pytest")
PROBE_IMPORTS = (
    "torch",
    "triton",
    "moe_serve.llm",
    "moe_serve.exporters.hf",
    "moe_serve.kernels.cuda",
    "fastapi",
    "uvicorn",
    "pydantic",
    "starlette",
    "moe_serve.server",
)


def probe(results: Results) -> None:
    from importlib import metadata

    data = results.data
    data["python"] = sys.version.split()[0]
    data["executable"] = sys.executable
    data["cpus"] = os.cpu_count()
    data["compiler"] = shutil.which("c++") or shutil.which("g++")
    data["versions"] = {}
    for name in PROBE_VERSIONS + ("fastapi", "uvicorn", "pydantic"):
        try:
            data["versions"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            data["versions"][name] = None
    results.save()
    data["cuda"] = cuda_info()
    results.save()
    data["imports"] = {module: try_import(module) for module in PROBE_IMPORTS}
    results.save()


def try_import(module: str) -> str:
    import importlib

    try:
        importlib.import_module(module)
    except Exception as exc:  # the text is the finding
        return f"{type(exc).__name__}: {exc}"[:500]
    return "ok"


def cuda_info() -> dict[str, Any]:
    try:
        import torch
    except Exception as exc:
        return {"available": False, "reason": f"torch is not importable ({type(exc).__name__}: {exc})"}
    info: dict[str, Any] = {"available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    if not info["available"]:
        return info | {"reason": "no CUDA device: torch.cuda.is_available() is False"}
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    info |= {
        "device": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "total_gib": round(total / 2**30, 2),
        "free_gib": round(free / 2**30, 2),
        "driver": nvidia_smi("driver_version"),
    }
    return info


def nvidia_smi(field_name: str) -> str | None:
    """One read-only query (the card's settings are never changed here)."""
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field_name}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


# ---- bench worker: building the model ----------------------------------------------------------------------------


class TensorDict:
    """A live transformers model's tensors, read the way exporters.hf reads a checkpoint (`name in`, `get(name,
    shape)`): the importer's own mapping converts them in memory, with no multi-GB file written. transformers 5
    keeps Mixtral's router and fused experts under `mlp.` in memory and saves them under `block_sparse_moe.`;
    both spellings are looked up."""

    ALIASES = ((".block_sparse_moe.", ".mlp."),)

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def _resolve(self, name: str) -> str | None:
        if name in self.state:
            return name
        for ours, theirs in self.ALIASES:
            if name.replace(ours, theirs) in self.state:
                return name.replace(ours, theirs)
        return None

    def __contains__(self, name: str) -> bool:
        return self._resolve(name) is not None

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> Any:
        resolved = self._resolve(name)
        if resolved is None:
            raise KeyError(f"the model has no tensor '{name}'")
        tensor = self.state[resolved]
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"'{resolved}' has shape {list(tensor.shape)}, expected {list(shape)}")
        return tensor


def build_hf(config: dict[str, int], device: str, seed: int) -> Any:
    """transformers' MixtralForCausalLM with its own random init (normal(0, 0.02), norms 1), built directly on
    `device` (bf16 on CUDA, fp32 for the CPU check of this script) so that a 3.5 B model takes seconds. Seeded:
    the same weights on every run."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(seed)
    hf_config = MixtralConfig(
        **config, bos_token_id=None, eos_token_id=None, pad_token_id=None, max_position_embeddings=4096
    )
    with torch.device(device):
        try:
            model = MixtralForCausalLM._from_config(hf_config, dtype=dtype)
        except TypeError:  # transformers before `dtype` replaced `torch_dtype`
            model = MixtralForCausalLM._from_config(hf_config, torch_dtype=dtype)
    return model.eval().requires_grad_(False)


def check_weights(model: Any) -> dict[str, Any]:
    """Every tensor finite, and none all zeros (zeros would hide unwritten outputs and run faster than data)."""
    import torch

    bad = [
        name
        for name, t in model.state_dict().items()
        if not bool(torch.isfinite(t).all()) or float(t.abs().max()) == 0.0
    ]
    if bad:
        raise RuntimeError(f"all-zero or non-finite tensors: {', '.join(bad)}")
    return {"tensors": len(model.state_dict())}


def to_artifact(hf_model: Any, name: str) -> Any:
    """The same weights as a moe-serve model, through exporters.hf's config and weight mapping (what `moe-serve
    export hf` runs), copied (router in fp32, the rest bf16) so the two models never share storage."""
    import torch

    from moe_serve.artifact import Artifact, storage_dtype
    from moe_serve.exporters.hf import convert_config, convert_weights
    from moe_serve.models import MoETransformer
    from moe_serve.tokenizer import Tokenizer, byte_level_tokenizer

    hf = hf_model.config.to_dict() | {"architectures": ["MixtralForCausalLM"]}
    dtype = next(hf_model.parameters()).dtype
    tokenizer = Tokenizer(byte_level_tokenizer())
    config = convert_config(hf, tokenizer)
    state = convert_weights(hf, config, TensorDict(hf_model.state_dict()), progress=False)  # type: ignore[arg-type]
    tensors = {key: t.detach().to(dtype=storage_dtype(key, dtype), copy=True) for key, t in state.items()}
    with torch.device("meta"):
        model = MoETransformer(config)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.eval().requires_grad_(False)
    model.prepare()
    provenance = {"exporter": "benchmarks.gpu_check.to_artifact (exporters.hf, in memory)"}
    return Artifact(Path(f"gpu-check-{name}"), config, tokenizer, model, provenance)


def make_llm(artifact: Any, device: str, graphs: bool, settings: BenchSettings) -> Any:
    """One engine per setting over the same loaded weights. Prefix caching off: every timed run prefills, so
    that the difference of two runs is decode steps only."""
    from moe_serve import LLM, EngineConfig

    dtype = "bfloat16" if device == "cuda" else "float32"
    config = EngineConfig(
        device=device,
        dtype=dtype,
        cuda_graphs=graphs,
        max_num_seqs=max(settings.batches),
        kv_cache_memory=settings.kv_cache_bytes,
        enable_prefix_caching=False,
    )
    return LLM(artifact, config)


# ---- bench worker: measurements ----------------------------------------------------------------------------------


def prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed * 1000 + batch * 7 + length)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(batch)]


def timed_generate(llm: Any, batch_prompts: list[list[int]], ks: list[int], new_tokens: int) -> float:
    """Seconds for moe-serve to generate exactly new_tokens per prompt, row i at k = ks[i % len(ks)]."""
    from moe_serve import SamplingParams

    params = [
        SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, experts_per_token=ks[i % len(ks)])
        for i in range(len(batch_prompts))
    ]
    start = time.perf_counter()
    outs = llm.generate(batch_prompts, params)
    seconds = time.perf_counter() - start
    if any(len(o.outputs[0].token_ids) != new_tokens for o in outs):
        raise RuntimeError("a request generated a different number of tokens than asked")
    return seconds


def decode_cell(llm: Any, batch_prompts: list[list[int]], ks: list[int], settings: BenchSettings) -> dict[str, float]:
    """One decode step's cost, prefill excluded: (t(new_tokens) - t(1)) / (new_tokens - 1) on the same prompts,
    median over reps after a warm-up; and the end-to-end generate rate (prefill included) for the comparison
    with transformers."""
    timed_generate(llm, batch_prompts, ks, settings.warmup_tokens)
    steps, fulls = [], []
    for _ in range(settings.reps):
        first = timed_generate(llm, batch_prompts, ks, 1)
        full = timed_generate(llm, batch_prompts, ks, settings.new_tokens)
        steps.append((full - first) / (settings.new_tokens - 1))
        fulls.append(full)
    step = statistics.median(steps)
    if step <= 0:  # a run of one token took as long as the full run: timing noise, not a figure
        raise RuntimeError(f"t({settings.new_tokens} tokens) was not longer than t(1 token): too noisy to measure")
    batch = len(batch_prompts)
    return {
        "step_ms": 1000 * step,
        "decode_tok_s": batch / step,
        "generate_tok_s": batch * settings.new_tokens / statistics.median(fulls),
    }


def prefill_cell(llm: Any, vocab: int, k: int, settings: BenchSettings) -> dict[str, float]:
    """Prompt tokens per second: prefill_prompts prompts of prefill_len tokens, one token generated each."""
    batch_prompts = prompts(vocab, settings.prefill_prompts, settings.prefill_len, settings.seed)
    timed_generate(llm, batch_prompts, [k], 1)
    seconds = statistics.median(timed_generate(llm, batch_prompts, [k], 1) for _ in range(settings.reps))
    return {"prefill_tok_s": settings.prefill_prompts * settings.prefill_len / seconds}


def hf_generate(model: Any, batch_prompts: list[list[int]], new_tokens: int) -> tuple[float, Any]:
    import torch

    ids = torch.tensor(batch_prompts, device=model.device)
    synchronize(model.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    synchronize(model.device)
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, not {new_tokens}")
    return time.perf_counter() - start, out[:, ids.shape[1] :]


def hf_cell(model: Any, batch_prompts: list[list[int]], settings: BenchSettings) -> dict[str, float]:
    """transformers `generate`, greedy, exactly new_tokens (min_new_tokens), at the model's trained k."""
    hf_generate(model, batch_prompts, settings.warmup_tokens)
    seconds = statistics.median(hf_generate(model, batch_prompts, settings.new_tokens)[0] for _ in range(settings.reps))
    return {"generate_tok_s": len(batch_prompts) * settings.new_tokens / seconds}


def parity_cell(llm: Any, model: Any, vocab: int, k: int, settings: BenchSettings) -> dict[str, Any]:
    """Do the two engines compute the same function? Greedy tokens of both on the same prompts: with random bf16
    weights near-ties can flip a token, so this is reported, not asserted."""
    from moe_serve import SamplingParams

    batch_prompts = prompts(vocab, settings.parity_prompts, settings.prompt_len, settings.seed + 1)
    params = SamplingParams(max_tokens=settings.parity_tokens, temperature=0, ignore_eos=True, experts_per_token=k)
    ours = [o.outputs[0].token_ids for o in llm.generate(batch_prompts, params)]
    theirs = hf_generate(model, batch_prompts, settings.parity_tokens)[1].tolist()
    prefixes = [common_prefix(a, b) for a, b in zip(ours, theirs, strict=True)]
    return {
        "prompts": len(prefixes),
        "tokens": settings.parity_tokens,
        "first_token_equal": sum(p > 0 for p in prefixes),
        "matching_prefix": prefixes,
    }


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def copy_bandwidth(device: str, mib: int = 1024, reps: int = 10) -> dict[str, float]:
    """The device's copy bandwidth as the roofline uses it: bytes read + written per second by a large
    device-to-device copy (random bytes), CUDA-event timed, the median of reps after three warm-ups."""
    import torch

    src = torch.randint(0, 256, (mib << 20,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del src, dst
    torch.cuda.empty_cache()
    return {"copy_gb_s": 2 * (mib << 20) / statistics.median(times) / 1e9, "buffer_mib": mib, "reps": reps}


def synchronize(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def release() -> None:
    """Frees what the last engine held (its KV cache, its graphs) before the next one allocates its own."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bench(results: Results, model_name: str, device: str, settings: BenchSettings) -> None:
    """One model, in priority order (a run short of time loses the least important cells): the copy bandwidth,
    the model, graphs at k = 2, parity and prefill, graphs at the other k, transformers, eager at k = 2, eager at
    the other k."""
    config = MODELS[model_name]
    shape = MoEShape.of(config)
    data = results.data
    dtype = "bfloat16" if device == "cuda" else "float32"
    data |= {"model": model_name, "config": config, "params": shape.params(), "device": device, "dtype": dtype}
    data["decode_bytes"] = {label: shape.decode_bytes(ks[0]) for label, ks in k_values(shape).items() if len(ks) == 1}
    data["settings"] = asdict(settings)
    results.save()
    if device == "cuda":
        results.attempt(data, "copy", settings.cell_floor_s, lambda: copy_bandwidth(device))
    hf_model = results.attempt(
        data, "build_hf", settings.build_floor_s, lambda: build_hf(config, device, settings.seed)
    )
    if hf_model is None:
        return
    results.attempt(data, "weights", settings.cell_floor_s, lambda: check_weights(hf_model))
    artifact = results.attempt(data, "convert", settings.build_floor_s, lambda: to_artifact(hf_model, model_name))
    if artifact is None:
        return
    synchronize(device)
    run_engine(results, artifact, hf_model, shape, device, settings, graphs=True)
    run_hf(results, hf_model, shape, settings)
    run_engine(results, artifact, None, shape, device, settings, graphs=False)


def cell_order(shape: MoEShape, batches: tuple[int, ...]) -> list[tuple[int, str]]:
    """(batch, k label): the trained k at every batch first, then the others; mixed needs two rows at least."""
    first = [(b, "2") for b in batches]
    rest = [(b, label) for b in batches for label in k_values(shape) if label != "2" and (b > 1 or label != "mixed")]
    return first + rest


def run_engine(
    results: Results, artifact: Any, hf_model: Any, shape: MoEShape, device: str, settings: BenchSettings, graphs: bool
) -> None:
    mode = "graphs" if graphs else "eager"
    where = results.data.setdefault(mode, {})
    llm = results.attempt(
        where, "build", settings.build_floor_s, lambda: make_llm(artifact, device, graphs, settings), f"{mode} engine"
    )
    if llm is None:
        return
    cells = where.setdefault("decode", {})
    ks = k_values(shape)
    for index, (batch, label) in enumerate(cell_order(shape, settings.batches)):
        batch_prompts = prompts(shape.vocab, batch, settings.prompt_len, settings.seed)
        row = cells.setdefault(str(batch), {})
        results.attempt(
            row,
            label,
            settings.cell_floor_s,
            lambda p=batch_prompts, k=ks[label]: decode_cell(llm, p, k, settings),
            f"{mode} decode batch {batch} k={label}",
        )
        if graphs and index == len(settings.batches) - 1:  # after the trained k: parity and prefill
            if hf_model is not None:
                results.attempt(
                    where, "parity", settings.cell_floor_s, lambda: parity_cell(llm, hf_model, shape.vocab, 2, settings)
                )
            results.attempt(
                results.data, "prefill", settings.cell_floor_s, lambda: prefill_cell(llm, shape.vocab, 2, settings)
            )
    llm = None
    release()


def run_hf(results: Results, hf_model: Any, shape: MoEShape, settings: BenchSettings) -> None:
    where = results.data.setdefault("hf", {})
    for batch in sorted(settings.batches, key=lambda b: (b == 1, b)):  # 16 and 64 first: the 3x goal
        batch_prompts = prompts(shape.vocab, batch, settings.prompt_len, settings.seed)
        results.attempt(
            where,
            str(batch),
            settings.cell_floor_s,
            lambda p=batch_prompts: hf_cell(hf_model, p, settings),
            f"transformers generate batch {batch}",
        )


def roofline(data: dict[str, Any], shape: MoEShape) -> dict[str, dict[str, float]]:
    """Batch-1 fraction of the HBM roofline: bytes the step reads at k / step time / copy bandwidth."""
    copy = data.get("copy", {}).get("copy_gb_s")
    out: dict[str, dict[str, float]] = {}
    for mode in ("graphs", "eager"):
        row = data.get(mode, {}).get("decode", {}).get("1", {})
        for label in ("1", "2", "N"):
            step_ms = row.get(label, {}).get("step_ms")
            if copy and step_ms:
                bytes_per_step = shape.decode_bytes(k_values(shape)[label][0])
                out.setdefault(mode, {})[label] = bytes_per_step / (step_ms / 1000) / (copy * 1e9)
    return out


# ---- the parent: phases, goals, report --------------------------------------------------------------------------


_GPU_MARK = re.compile(r"^\s*(pytestmark\s*=.*\bpytest\.mark\.gpu\b|@pytest\.mark\.gpu\b)", re.MULTILINE)


def gpu_test_files() -> list[str]:
    """The test files that use the gpu mark (a module's pytestmark or a decorator): collecting only these keeps
    pytest off the modules that import what the image lacks (schemathesis, playwright, openai ...), whose
    collection errors would stop the run."""
    # Kernel tests first: when something fails, the kernel that fails is the most telling result.
    files = sorted(ROOT.glob("tests/**/test_*.py"), key=lambda p: ("kernel" not in p.name, str(p)))
    return [str(p.relative_to(ROOT)) for p in files if _GPU_MARK.search(p.read_text(errors="replace"))]


def tests_phase(phase: Phase, env: dict[str, str], out: Path) -> None:
    files = gpu_test_files()
    if not files:
        phase.reason = "no test file mentions pytest.mark.gpu"
        return
    xml = out / "gpu_tests.xml"
    # Not -x: one failure must not hide the rest of a run that cannot be repeated at will; a hung test costs
    # at most its own timeout.
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "--maxfail=10",
        "--timeout=60",
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    command += [f"--junitxml={xml}", *files]
    assert phase.limit_s is not None
    status, reason = run_logged(command, phase.limit_s, env, out / "gpu_tests.log", "pytest -m gpu")
    phase.data = {"files": files} | junit_counts(xml)
    phase.status, phase.reason = status, reason
    if status == "failed" and reason.startswith("exit status 5"):
        phase.status, phase.reason = "skipped", "no test selected by -m gpu"


def junit_counts(xml: Path) -> dict[str, int]:
    if not xml.is_file():
        return {}
    try:
        root = ET.parse(xml).getroot()
    except ET.ParseError:
        return {}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    return {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}


def why_no_gpu(probe_phase: Phase) -> str | None:
    """The reason the GPU phases cannot run, or None."""
    cuda = probe_phase.data.get("cuda")
    if cuda is None:
        return f"the probe did not report CUDA ({probe_phase.status}: {probe_phase.reason})"
    if not cuda.get("available"):
        return cuda.get("reason") or "no CUDA device"
    return None


def goals(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The goal figures on the large model, reported (not asserted)."""
    large = report["phases"].get("bench-large", {}).get("data", {})
    graphs = large.get("graphs", {}).get("decode", {})
    eager = large.get("eager", {}).get("decode", {})
    rows = [
        {
            "goal": "batch-1 decode >= 70% of the HBM roofline at k=2 (large, graphs)",
            "value": large.get("roofline", {}).get("graphs", {}).get("2"),
            "target": GOALS["roofline_k2_batch1"],
            "unit": "fraction",
        }
    ]
    for batch in ("16", "64"):
        ours = graphs.get(batch, {}).get("2", {}).get("generate_tok_s")
        theirs = large.get("hf", {}).get(batch, {}).get("generate_tok_s")
        rows.append(
            {
                "goal": f">= 3x transformers generate at batch {batch} (large, graphs, k=2)",
                "value": ours / theirs if ours and theirs else None,
                "target": GOALS["hf_ratio"],
                "unit": "x",
            }
        )
    graph_ms = graphs.get("1", {}).get("2", {}).get("step_ms")
    eager_ms = eager.get("1", {}).get("2", {}).get("step_ms")
    rows.append(
        {
            "goal": "CUDA graphs at least halve the batch-1 step time (large, k=2)",
            "value": eager_ms / graph_ms if graph_ms and eager_ms else None,
            "target": GOALS["graph_speedup_batch1"],
            "unit": "x",
        }
    )
    for row in rows:
        row["met"] = None if row["value"] is None else row["value"] >= row["target"]
    return rows


def fmt(value: Any, digits: int = 0) -> str:
    return "–" if not isinstance(value, int | float) else f"{value:,.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    probe_data = report["phases"]["probe"]["data"]
    cuda = probe_data.get("cuda", {})
    versions = probe_data.get("versions", {})
    lines = [
        f"## GPU check, {report['started']}",
        "",
        f"{cuda.get('device', 'no CUDA device')}"
        + (
            f" ({cuda.get('sm_count')} SMs, {cuda.get('free_gib')} of {cuda.get('total_gib')} GiB free)"
            if cuda.get("device")
            else ""
        )
        + f"; python {probe_data.get('python', '?')}, torch {versions.get('torch')}, triton {versions.get('triton')}, "
        f"transformers {versions.get('transformers')}; {report['wall_s']:.0f} s of a {report['budget_s']:.0f} s budget",
        "",
        "| phase | status | seconds | note |",
        "|---|---|---|---|",
    ]
    for name, phase in report["phases"].items():
        note = phase["reason"] or phase_note(name, phase)
        lines.append(f"| {name} | {phase['status']} | {phase['seconds']:.1f} | {note[:300]} |")
    for name in ("large", "medium"):
        data = report["phases"].get(f"bench-{name}", {}).get("data", {})
        if data.get("config"):
            lines += [""] + model_tables(name, data)
    if any(row["value"] is not None for row in report["goals"]):
        lines += ["", "| goal | measured | target | met |", "|---|---|---|---|"]
        for row in report["goals"]:
            met = {True: "yes", False: "no", None: "–"}[row["met"]]
            lines.append(f"| {row['goal']} | {fmt(row['value'], 2)} | {row['target']} | {met} |")
    return "\n".join(lines)


def phase_note(name: str, phase: dict[str, Any]) -> str:
    data = phase.get("data", {})
    if name == "setup":
        wheels = data.get("wheels", {})
        note = f"wheels: {wheels.get('status')} ({len(wheels.get('installed', []))} installed)"
        if "editable_install" in data:
            note += f"; editable install: {data['editable_install']['status']}"
        return note
    if name == "probe" and data.get("imports"):
        failing = [module for module, result in data["imports"].items() if result != "ok"]
        return "imports failing: " + ", ".join(failing) if failing else "every probed module imports"
    if name.startswith("bench-") and data.get("config"):
        modes = [data.get(mode, {}).get("decode", {}) for mode in ("graphs", "eager")]
        cells = [cell for rows in modes for row in rows.values() for cell in row.values()]
        measured = sum("step_ms" in cell for cell in cells)
        return f"{measured} of {len(cells)} decode cells measured; {len(problem_cells(data))} entries not measured"
    if name == "tests" and "tests" in data:
        return f"{data['tests']} tests, {data['failures']} failed, {data['errors']} errors, {data['skipped']} skipped"
    return ""


def model_tables(name: str, data: dict[str, Any]) -> list[str]:
    c = data["config"]
    n = c["num_local_experts"]
    built = data.get("build_hf", {}).get("wall_s"), data.get("convert", {}).get("wall_s")
    build = lambda mode: data.get(mode, {}).get("build", {}).get("wall_s")
    lines = [
        f"### {name}: {data['params'] / 1e9:.2f} B parameters (hidden {c['hidden_size']}, {c['num_hidden_layers']} "
        f"layers, {n} experts of {c['intermediate_size']}, top-{c['num_experts_per_tok']}, vocabulary "
        f"{c['vocab_size']}), {data.get('dtype')}; transformers init {fmt(built[0], 1)} s, conversion "
        f"{fmt(built[1], 1)} s; "
        f"copy bandwidth {fmt(data.get('copy', {}).get('copy_gb_s'))} GB/s",
        "",
        f"decode tok/s (step ms), CUDA graphs / eager; engine build {fmt(build('graphs'), 1)} / "
        f"{fmt(build('eager'), 1)} s",
        "",
        f"| batch | k=1 | k=2 | k=N={n} | mixed 1,2,{n} |",
        "|---|---|---|---|---|",
    ]
    for batch in map(str, data.get("settings", {}).get("batches", [])):
        cells = []
        for label in ("1", "2", "N", "mixed"):
            if batch == "1" and label == "mixed":
                cells.append("n/a (one row)")
                continue
            g = data.get("graphs", {}).get("decode", {}).get(batch, {}).get(label, {})
            e = data.get("eager", {}).get("decode", {}).get(batch, {}).get(label, {})
            cells.append(
                f"{fmt(g.get('decode_tok_s'))} ({fmt(g.get('step_ms'), 2)}) / "
                f"{fmt(e.get('decode_tok_s'))} ({fmt(e.get('step_ms'), 2)})"
            )
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    hf = data.get("hf", {})
    graphs = data.get("graphs", {}).get("decode", {})
    settings = data.get("settings", {})
    lines += [
        "",
        f"generate tok/s at k=2, prefill included ({settings.get('prompt_len')}-token prompts, "
        f"{settings.get('new_tokens')} new tokens): moe-serve (graphs) / transformers: "
        + ", ".join(
            f"batch {b}: {fmt(graphs.get(b, {}).get('2', {}).get('generate_tok_s'))} / "
            f"{fmt(hf.get(b, {}).get('generate_tok_s'))}"
            for b in map(str, data.get("settings", {}).get("batches", []))
        ),
        f"prefill: {fmt(data.get('prefill', {}).get('prefill_tok_s'))} tok/s "
        f"({data.get('settings', {}).get('prefill_prompts')} prompts of {data.get('settings', {}).get('prefill_len')})",
        "batch-1 roofline fraction (graphs / eager): "
        + ", ".join(
            f"k={label}: {pct(data.get('roofline', {}).get('graphs', {}).get(label))} / "
            f"{pct(data.get('roofline', {}).get('eager', {}).get(label))}"
            for label in ("1", "2", "N")
        ),
    ]
    parity = data.get("graphs", {}).get("parity", {})
    if "prompts" in parity:
        lines.append(
            f"parity with transformers (greedy, {parity['tokens']} tokens): first token equal on "
            f"{parity['first_token_equal']} of {parity['prompts']} prompts, matching prefixes "
            f"{parity['matching_prefix']}"
        )
    problems = sorted(problem_cells(data))
    if problems:
        lines.append("not measured: " + "; ".join(problems)[:1500])
    return lines


def pct(value: Any) -> str:
    return "–" if not isinstance(value, float) else f"{100 * value:.1f}%"


def problem_cells(data: Any, path: str = "") -> list[str]:
    """Every 'skipped' or 'error' entry under data, as 'path: reason'."""
    if not isinstance(data, dict):
        return []
    found = [f"{path or '.'}: {data[key]}"[:300] for key in ("skipped", "error") if key in data]
    for key, value in data.items():
        found += problem_cells(value, f"{path}/{key}" if path else key)
    return found


def write_report(report: dict[str, Any], out: Path) -> str:
    """The JSON first, so that a bug in the tables cannot lose the figures."""
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    try:
        text = markdown(report)
    except Exception as exc:  # the figures are in the JSON; say why the tables are missing
        text = f"## GPU check\n\nthe tables could not be written ({type(exc).__name__}: {exc}); see gpu_check.json"
    (out / "gpu_check.md").write_text(text + "\n")
    return text


class Check:
    """One run of the check: the shared clock, the phases' records, and what every phase process inherits."""

    bench_models = ("large", "medium")  # in this order: the goals are measured on the large one

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.budget = Budget(total_s=args.budget_s)
        self.clock = Clock(self.budget.total_s)
        self.out: Path = args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = self.out / "gpu_check.log"
        self.log.write_text("")
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        self.phases = {name: Phase(name) for name in PHASES}
        self.scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        self.started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def timed(self, name: str, limit: float, body: Callable[[Phase], Any]) -> None:
        """Runs body(phase) if at least a second of its limit is left; whatever it raises is the phase's failure."""
        phase = self.phases[name]
        phase.limit_s = round(max(limit, 0.0), 1)
        if phase.limit_s < 1.0:
            phase.status, phase.reason = "skipped", f"time budget: {self.clock.left():.0f} s left"
            return
        self.say(f"{name} (limit {phase.limit_s:.0f} s)")
        start = time.monotonic()
        try:
            body(phase)
        except Exception as exc:  # a broken phase is recorded; the others still run
            phase.status, phase.reason = "failed", f"{type(exc).__name__}: {exc}"
        phase.seconds = round(time.monotonic() - start, 2)
        self.say(f"{name}: {phase.status} {phase.reason[:200]}")

    def say(self, text: str) -> None:
        print(f"[gpu-check {self.clock.elapsed():5.0f} s] {text}", flush=True)

    def worker(self, phase: Phase, argv: list[str]) -> None:
        phase.data.update(run_worker(phase, argv, self.env, self.log, self.scratch, self.budget))

    def run(self) -> dict[str, Any]:
        budget, clock = self.budget, self.clock
        self.timed("setup", min(budget.setup_s, clock.left()), lambda phase: setup(phase, self.args, self.env))
        prebuild = start_cpu_kernel_build(self.env, self.log)
        self.timed(
            "probe",
            min(budget.probe_s, clock.left() - budget.report_s),
            lambda p: self.worker(p, ["--worker", "probe"]),
        )
        no_gpu = why_no_gpu(self.phases["probe"])
        if no_gpu is None:
            self.gpu_phases()
        else:
            for name in ("tests", "bench-large", "bench-medium"):
                self.phases[name].reason = no_gpu
        stop(prebuild, self.phases["setup"])
        shutil.rmtree(self.scratch, ignore_errors=True)
        return self.report()

    def gpu_phases(self) -> None:
        budget, clock = self.budget, self.clock
        tests_limit = min(budget.tests_s, clock.left() - budget.bench_min_s - budget.report_s)
        self.timed("tests", tests_limit, lambda phase: tests_phase(phase, self.env, self.out))
        for name in self.bench_models:
            left = clock.left() - budget.report_s
            limit = left * budget.large_share if name == "large" else left
            self.timed(f"bench-{name}", limit, lambda p, n=name: self.worker(p, ["--worker", "bench", "--model", n]))
            data = self.phases[f"bench-{name}"].data
            if data.get("config"):  # here, not in the worker: a worker killed for time still gets its figure
                data["roofline"] = roofline(data, MoEShape.of(data["config"]))

    def report(self) -> dict[str, Any]:
        report: dict[str, Any] = {
            "started": self.started,
            "budget_s": self.budget.total_s,
            "wall_s": round(self.clock.elapsed(), 1),
            "phases": {name: asdict(phase) for name, phase in self.phases.items()},
        }
        report["goals"] = goals(report)
        print(write_report(report, self.out), flush=True)
        return report


def worker_main(args: argparse.Namespace) -> None:
    """A phase's own process: writes its results to --result (a failure is recorded there, not raised)."""
    results = Results(args.result, args.deadline)
    try:
        if args.worker == "probe":
            probe(results)
        else:
            settings = QUICK if args.quick else BenchSettings()
            bench(results, args.model, args.device, settings)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        results.data["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    results.save()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "gpu-check-out"
    parser.add_argument(
        "--out", type=Path, default=default_out, help="results folder (default $OUT or ./gpu-check-out)"
    )
    parser.add_argument("--budget-s", type=float, default=Budget().total_s, help="wall-clock budget of the whole check")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="carried wheels (make gpu-wheels)")
    parser.add_argument("--site", type=Path, default=Path(tempfile.gettempdir()) / "moe-serve-gpu-site")
    parser.add_argument("--worker", choices=["probe", "bench"], help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=sorted(MODELS), default="large", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
    else:
        Check(args).run()


if __name__ == "__main__":
    main()
