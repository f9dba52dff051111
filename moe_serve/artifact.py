"""The serving artifact (docs/architecture.md §2, docs/artifact-format.md): save, validate, load.

A directory with config.json, model.safetensors, tokenizer.json and optionally quality.json. Loading
checks everything before any weight is used and raises ArtifactError with one message naming the
problem. Weights are read with safetensors only: nothing is ever unpickled.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe_serve.errors import ArtifactError, ConfigError
from moe_serve.kernels import has_bf16_dot, hugepages
from moe_serve.kernels.packed import (
    PackedWeight,
    WeightFormat,
    from_stored,
    mode_reads,
    packed_shapes,
    quantize,
    weights_label,
)
from moe_serve.model_config import ModelConfig
from moe_serve.models import MoETransformer
from moe_serve.output_dir import check_destination, written_aside
from moe_serve.quality import QUALITY_FILE, QualityTable
from moe_serve.tokenizer import Tokenizer
from moe_serve.weights import (
    MANIFEST_KEY,
    WeightsSpec,
    activations_for,
    expected_tensors,
    install,
    pack,
    packable_weights,
)

logger = logging.getLogger(__name__)

FORMAT = "moe-serve"
FORMAT_VERSION = 1  # what an artifact of float tensors is written as: readable by every runtime
PACKED_FORMAT_VERSION = 2  # version 2 adds the "weights" section: weights stored packed (bf16, int8, int4)
SUPPORTED_FORMAT_VERSIONS = (1, 2)
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
STORAGE_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_PACKED_SAFETENSORS_DTYPES = {torch.int8: "I8", torch.uint8: "U8", torch.float16: "F16", torch.bfloat16: "BF16"}


@dataclass(slots=True)
class Artifact:
    """A loaded artifact: the model (eval mode, on its device) and everything needed to serve it; what the
    torch backend serves (an engine.runner.LoadedModel)."""

    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    model: MoETransformer
    provenance: dict[str, Any] = field(default_factory=dict)
    quality: QualityTable | None = None
    weights: WeightsSpec | None = None  # weights stored packed (None: every tensor a float tensor)
    activations: str = "fp32"  # --cpu-activations as it applied to the packed weights: fp32, int8 or auto

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's activations and KV cache."""
        return self.model.embed_tokens.weight.dtype

    @property
    def weight_format(self) -> str | None:
        return self.weights.format.value if self.weights is not None else None

    @property
    def weights_label(self) -> str | None:
        """The weight format and activations quality rows name (packed.weights_label: "int8", "int8:int8")."""
        return weights_label(self.weights.format.value, self.activations) if self.weights is not None else None


def sha256_file(path: Path, read: Callable[[int], object] | None = None) -> str:
    """The file's sha256, read in chunks (`read`: told each chunk's size, for a progress bar)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
            if read is not None:
                read(len(chunk))
    return digest.hexdigest()


def is_router_tensor(name: str) -> bool:
    """Router weights (the router linear and SMEAR's router input norm) are stored and loaded in fp32
    whatever the dtype of the rest (docs/architecture.md §3: bf16 rounding flips top-k sets)."""
    return ".moe.router." in name or ".moe.router_norm." in name


def storage_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype tensor `name` is written or loaded in when the model's dtype is `dtype`."""
    return torch.float32 if is_router_tensor(name) and dtype.itemsize < 4 else dtype


def save_artifact(
    dst: str | Path,
    config: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    tokenizer: Tokenizer,
    *,
    provenance: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    weights: WeightFormat | None = None,
    overwrite: bool = False,
    sources: tuple[Path, ...] = (),
) -> Path:
    """Write an artifact. The directory is written aside and renamed into place, so a failure never
    leaves a half-written DST (moe_serve.output_dir: overwrite replaces only an artifact or an empty directory,
    never one holding one of `sources`). Tensors are checked against the config, and must be finite, before
    anything is written. weights: store the packable weights in this format (moe_serve.weights; fp32 or None:
    as floats)."""
    dst = Path(dst)
    check_destination(dst, overwrite=overwrite, is_ours=is_artifact_dir, sources=sources, error=ArtifactError)
    if tokenizer.vocab_size > config.vocab_size:
        raise ArtifactError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model vocab_size is {config.vocab_size}"
        )
    check_tensors(config, {name: tuple(t.shape) for name, t in state_dict.items()})
    tensors = {
        name: t.detach().to("cpu", storage_dtype(name, dtype or t.dtype)).contiguous() for name, t in state_dict.items()
    }
    for name, t in tensors.items():
        if t.dtype not in STORAGE_DTYPES:
            raise ArtifactError(f"tensor '{name}' has dtype {t.dtype}; artifacts store float32, float16 or bfloat16")
        if not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ArtifactError(f"tensor '{name}' has {bad} non-finite values (NaN or inf): the checkpoint is broken")
    spec = None
    if weights is not None and WeightFormat(weights) is not WeightFormat.FP32:
        tensors, spec = pack(config, tensors, WeightFormat(weights))

    with written_aside(dst, ArtifactError) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE))
        tokenizer.save(tmp / TOKENIZER_FILE)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION if spec is None else PACKED_FORMAT_VERSION,
            "model": config.to_dict(),
            **({MANIFEST_KEY: spec.to_dict()} if spec is not None else {}),
            "provenance": {"created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **(provenance or {})},
            "checksums": {name: sha256_file(tmp / name) for name in (WEIGHTS_FILE, TOKENIZER_FILE)},
        }
        (tmp / CONFIG_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        # mkdtemp makes the directory private: give the artifact ordinary permissions (umask applies).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        for path in tmp.iterdir():
            os.chmod(path, 0o666 & ~umask)
    return dst


def is_artifact_dir(path: Path) -> bool:
    """Whether `path` is a directory an artifact write made: a moe-serve config.json, no subdirectory."""
    try:
        manifest = json.loads((path / CONFIG_FILE).read_bytes())
        is_ours = isinstance(manifest, dict) and manifest.get("format") == FORMAT
        return is_ours and not any(entry.is_dir() for entry in path.iterdir())
    except (OSError, ValueError, RecursionError):
        return False


def read_manifest(path: str | Path) -> tuple[dict[str, Any], ModelConfig]:
    """Read and validate config.json: format, version and the model config."""
    path = Path(path)
    if not path.is_dir():
        raise ArtifactError(f"{path} is not an artifact directory (it does not exist or is not a directory)")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise ArtifactError(f"{path} has no {CONFIG_FILE}")
    try:
        manifest = json.loads(config_path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ArtifactError(f"{config_path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ArtifactError(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        if isinstance(manifest, dict) and ("architectures" in manifest or "model_type" in manifest):
            raise ArtifactError(
                f"{path} is a Hugging Face checkpoint, not a moe-serve artifact: `moe-serve serve {path}` serves it "
                f"(exported on first use), `moe-serve export hf {path} DST` exports it"
            )
        raise ArtifactError(
            f'{config_path} is not a moe-serve artifact config ("format" must be "{FORMAT}") nor a Hugging Face '
            "checkpoint's: export a trained checkpoint with `moe-serve export FORMAT SRC DST` (formats: "
            "`moe-serve export --help`), or serve a Hugging Face directory with `moe-serve serve DIR`"
        )
    checksums = manifest.get("checksums", {})
    if not (isinstance(checksums, dict) and all(isinstance(v, str) for v in checksums.values())):
        raise ArtifactError(f'{config_path}: "checksums" must be an object of file names to sha256 strings')
    if not isinstance(manifest.get("provenance", {}), dict):
        raise ArtifactError(f'{config_path}: "provenance" must be an object')
    version = manifest.get("format_version")
    if version not in SUPPORTED_FORMAT_VERSIONS:
        supported = ", ".join(map(str, SUPPORTED_FORMAT_VERSIONS))
        raise ArtifactError(f"unknown format_version {version!r} in {config_path}; this runtime reads {supported}")
    try:
        config = ModelConfig.from_dict(manifest.get("model"))
    except ConfigError as exc:
        raise ConfigError(f"{config_path}: {exc}") from None
    weights_spec(manifest, config, config_path)  # checked here, with everything else the manifest says
    return manifest, config


def weights_spec(manifest: dict[str, Any], config: ModelConfig, where: Path | str = CONFIG_FILE) -> WeightsSpec | None:
    """The manifest's weights section (None: float tensors only); version 2 and later only."""
    if MANIFEST_KEY not in manifest:
        return None
    if manifest.get("format_version", 1) < PACKED_FORMAT_VERSION:
        raise ArtifactError(
            f'{where}: "{MANIFEST_KEY}" needs format_version {PACKED_FORMAT_VERSION}; this file says '
            f"{manifest.get('format_version')}"
        )
    return WeightsSpec.parse(manifest[MANIFEST_KEY], config, str(where))


def load_artifact(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    verify_checksums: bool = True,
    pack_as: WeightFormat | None = None,
    cpu_activations: str = "fp32",
) -> Artifact:
    """Load and validate an artifact: everything serving will use is checked here (config, checksums,
    tokenizer, chat template, quality table, every tensor's name, shape, dtype and values), so that an
    artifact either fails to load with one ArtifactError naming the problem or serves.
    pack_as: pack the float weights in this format as they load (what `moe-serve quantize` would store;
    `moe-serve eval --weights` compares formats this way without writing artifacts).
    cpu_activations: packed.CPU_ACTIVATIONS, what the CPU kernels may round the packed weights' inputs to."""
    path = Path(path)
    manifest, config = read_manifest(path)
    for name in (WEIGHTS_FILE, TOKENIZER_FILE):
        if not (path / name).is_file():
            raise ArtifactError(f"{path} has no {name}")
    if verify_checksums:
        check_checksums(path, manifest.get("checksums") or {})
    tokenizer = read_tokenizer(path / TOKENIZER_FILE, config)
    if config.chat_template is not None:
        _check_chat_template(config.chat_template, path / CONFIG_FILE)
    quality = QualityTable.read(path / QUALITY_FILE) if (path / QUALITY_FILE).is_file() else None
    spec = weights_spec(manifest, config, path / CONFIG_FILE)
    if spec is not None and pack_as is not None:
        raise ArtifactError(
            f"{path} already stores {spec.format.value} weights; it cannot be packed again as "
            f"{WeightFormat(pack_as).value}"
        )
    packing = WeightFormat(pack_as) if pack_as is not None and WeightFormat(pack_as) is not WeightFormat.FP32 else None
    if spec is not None or packing is not None:
        check_packed_serving(spec.format if spec is not None else packing, torch.device(device), dtype)  # type: ignore[arg-type]
    tensors, packed = read_tensors(path / WEIGHTS_FILE, config, device, dtype, spec)
    if packing is not None:
        spec = WeightsSpec(packing, tuple(packable_weights(config, packing)))
        packed = {name: quantize(tensors.pop(name), packing, name) for name in spec.packed}
    activations = "fp32"
    if spec is not None:
        wants_bf16 = mode_reads(spec.format, cpu_activations) == "bf16"
        bf16_dot = wants_bf16 and has_bf16_dot()
        packed = {
            name: w.with_activations(activations_for(name, spec.format, cpu_activations, bf16_dot))
            for name, w in packed.items()
        }
        rounded = collections.Counter(w.activations for w in packed.values() if w.activations != "fp32")
        for kind, count in rounded.items():
            logger.info(
                "%d of %d %s weights read %s activations (--cpu-activations %s)",
                count,
                len(packed),
                spec.format.value,
                kind,
                cpu_activations,
            )
        if rounded:
            activations = cpu_activations
        elif wants_bf16:
            logger.warning(
                "--cpu-activations %s: this CPU has no bf16 dot products (AVX-512 BF16), so the bf16 weights "
                "keep fp32 activations",
                cpu_activations,
            )

    with torch.device("meta"):
        model = MoETransformer(config)
    model.load_state_dict(tensors, strict=not packed, assign=True)
    install(model, packed)
    model.eval().requires_grad_(False)
    model.prepare()
    return Artifact(path, config, tokenizer, model, manifest.get("provenance") or {}, quality, spec, activations)


def check_packed_serving(fmt: WeightFormat, device: torch.device, dtype: torch.dtype) -> None:
    """Packed weights are read by the CPU kernels, with float32 activations: refuse anything else by name."""
    if device.type != "cpu":
        raise ArtifactError(
            f"{fmt.value} weights are read by the CPU kernels; they cannot run on {device.type} (pass --device cpu, "
            "or serve the float artifact they were quantized from there)"
        )
    if dtype != torch.float32:
        raise ArtifactError(
            f"{fmt.value} weights run with float32 activations; --dtype "
            f"{STORAGE_DTYPES.get(dtype, dtype)} is refused (use --dtype float32 or auto)"
        )
    from moe_serve.kernels import cpu_extension

    if cpu_extension() is None:  # correct, but every product dequantizes its whole weight first
        logger.warning("%s weights without the C++ CPU kernels: every product dequantizes its weight (slow)", fmt.value)


def read_tensors(
    path: Path, config: ModelConfig, device: str | torch.device, dtype: torch.dtype | None, spec: WeightsSpec | None
) -> tuple[dict[str, torch.Tensor], dict[str, PackedWeight]]:
    """Every tensor the config describes, with the shape it describes, finite: float tensors stored as F32,
    F16 or BF16 (returned in `dtype`'s storage dtype; None: as stored), packed weights (spec) with the dtypes
    their format stores. -> (float tensors, packed)."""
    tensors: dict[str, torch.Tensor] = {}
    packed: dict[str, PackedWeight] = {}
    logical = expected_tensors(config) if spec is not None else {}
    layouts = packed_layouts(logical, spec)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
            check_tensors(config, shapes, spec)
            parts: dict[str, dict[str, torch.Tensor]] = {}
            for name in f.keys():
                dtype_name = f.get_slice(name).get_dtype()
                if name in layouts:  # a packed weight's data or scales
                    weight, suffix, expected = layouts[name]
                    if dtype_name != _PACKED_SAFETENSORS_DTYPES[expected]:
                        raise ArtifactError(
                            f"tensor '{name}' has dtype {dtype_name}; {spec.format.value} weights store "  # type: ignore[union-attr]
                            f"{_PACKED_SAFETENSORS_DTYPES[expected]} there"
                        )
                    tensor = f.get_tensor(name)
                    _check_packed_values(name, tensor, spec.format, path)  # type: ignore[union-attr]
                    parts.setdefault(weight, {})[suffix] = hugepages.place(tensor, tensor.dtype, device)
                    continue
                if dtype_name not in _SAFETENSORS_DTYPES:
                    raise ArtifactError(f"tensor '{name}' has dtype {dtype_name}; artifacts store F32, F16 or BF16")
                tensor = f.get_tensor(name)
                if not torch.isfinite(tensor).all():
                    raise ArtifactError(f"tensor '{name}' in {path.name} holds NaN or infinite values")
                stored_as = tensor.dtype if dtype is None else storage_dtype(name, dtype)
                tensors[name] = hugepages.place(tensor, stored_as, device)  # one copy
            if spec is not None:
                packed = {w: from_stored(spec.format, p, logical[w]) for w, p in parts.items()}
    except ArtifactError:
        raise
    except Exception as exc:  # safetensors raises its own errors for corrupt or truncated files
        raise ArtifactError(f"cannot read {path}: {exc}") from None
    return tensors, packed


def _check_packed_values(name: str, tensor: torch.Tensor, fmt: WeightFormat, path: Path) -> None:
    """Scales (and bf16 weights) finite; int8 values in [-127, 127], the range quantize writes."""
    if tensor.is_floating_point():
        if not torch.isfinite(tensor).all():
            raise ArtifactError(f"tensor '{name}' in {path.name} holds NaN or infinite values")
    elif fmt is WeightFormat.INT8 and tensor.numel() and int(tensor.min()) < -127:
        raise ArtifactError(f"tensor '{name}' in {path.name} holds -128; int8 weights lie in [-127, 127]")


def packed_layouts(
    shapes: dict[str, tuple[int, ...]], spec: WeightsSpec | None
) -> dict[str, tuple[str, str, torch.dtype]]:
    """Stored name -> (weight name, suffix, dtype) of every tensor the spec's packed weights store (shapes:
    the weights' logical shapes, expected_tensors)."""
    if spec is None:
        return {}
    return {
        f"{weight}{suffix}": (weight, suffix, layout_dtype)
        for weight in spec.packed
        for suffix, (_, layout_dtype) in packed_shapes(shapes[weight], spec.format).items()
    }


# Encoded and decoded at load: a tokenizer that cannot handle ordinary text (a WordLevel model without an
# unknown token, say) fails here rather than in every request.
_TOKENIZER_PROBE = "Hello, world! 0123 naïve café, Ελληνικά, 日本語 🙂\n\ttabs  and  spaces"


def read_tokenizer(path: Path, config: ModelConfig) -> Tokenizer:
    try:
        tokenizer = Tokenizer.from_file(path)
        ids = tokenizer.encode(_TOKENIZER_PROBE) + tokenizer.encode_rendered(_TOKENIZER_PROBE)
        tokenizer.decode(ids)
        tokenizer.max_token_chars  # noqa: B018  # decodes every token once
    except Exception as exc:  # the tokenizers library raises plain Exceptions
        raise ArtifactError(f"{path} cannot be used: {exc}") from None
    if tokenizer.vocab_size > config.vocab_size or any(i >= config.vocab_size for i in ids):
        raise ArtifactError(
            f"{TOKENIZER_FILE} has {tokenizer.vocab_size} tokens but the model vocab_size is {config.vocab_size}"
        )
    return tokenizer


def _check_chat_template(source: str, where: Path) -> None:
    from jinja2 import TemplateError

    from moe_serve.chat_template import TemplateEnvironment

    try:
        TemplateEnvironment(cap=0).parse(source)
    except TemplateError as exc:
        raise ArtifactError(f"{where}: chat_template is not a valid Jinja template: {exc}") from None


def check_checksums(path: Path, checksums: dict[str, str]) -> None:
    for name in (WEIGHTS_FILE, TOKENIZER_FILE):
        recorded = checksums.get(name)
        if recorded is None:
            raise ArtifactError(f"{path / CONFIG_FILE} records no sha256 checksum for {name}")
        try:
            actual = sha256_file(path / name)
        except OSError as exc:
            raise ArtifactError(f"cannot read {path / name}: {exc.strerror or exc}") from None
        if actual != recorded:
            raise ArtifactError(
                f"checksum mismatch for {name}: config.json records sha256 {recorded[:16]}…, the file "
                f"has {actual[:16]}…"
            )


def stored_tensors(config: ModelConfig, spec: WeightsSpec | None = None) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor an artifact of `config` stores (packed weights under their stored names)."""
    expected = expected_tensors(config)
    if spec is None:
        return expected
    for weight in spec.packed:
        shape = expected.pop(weight)
        expected.update({f"{weight}{suffix}": s for suffix, (s, _) in packed_shapes(shape, spec.format).items()})
    return expected


def check_tensors(config: ModelConfig, shapes: dict[str, tuple[int, ...]], spec: WeightsSpec | None = None) -> None:
    expected = stored_tensors(config, spec)
    missing = [name for name in expected if name not in shapes]
    if missing:
        name = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ArtifactError(f"missing tensor '{name}' (expected shape {list(expected[name])}){more}")
    unexpected = [name for name in shapes if name not in expected]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ArtifactError(f"unexpected tensor '{unexpected[0]}' not described by the config{more}")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise ArtifactError(f"tensor '{name}' has shape {list(shapes[name])}, expected {list(shape)}")
