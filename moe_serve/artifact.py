"""The serving artifact (docs/architecture.md §2, docs/artifact-format.md): save, validate, load.

A directory with config.json, model.safetensors, tokenizer.json and optionally quality.json. Loading
checks everything before any weight is used and raises ArtifactError with one message naming the
problem. Weights are read with safetensors only: nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe_serve.errors import ArtifactError, ConfigError
from moe_serve.kernels import hugepages
from moe_serve.model_config import ModelConfig
from moe_serve.models import MoETransformer
from moe_serve.quality import QUALITY_FILE, QualityTable
from moe_serve.tokenizer import Tokenizer

if TYPE_CHECKING:  # the engine imports this module; the artifact names its types only to make a runner
    from moe_serve.config import EngineConfig
    from moe_serve.engine.kv_cache import CacheShape
    from moe_serve.engine.runner import Runner

FORMAT = "moe-serve"
FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS = (1,)
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
STORAGE_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


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

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's activations and KV cache."""
        return self.model.embed_tokens.weight.dtype

    def make_runner(self, device: torch.device, cache_shape: CacheShape, engine_config: EngineConfig) -> Runner:
        # Imported here: the artifact is read and written without an engine (exporters, `moe-serve inspect`).
        from moe_serve.engine.model_runner import TorchRunner

        return TorchRunner(self.model, device, cache_shape, self.dtype, engine_config)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_router_tensor(name: str) -> bool:
    """Router weights (the router linear and SMEAR's router input norm) are stored and loaded in fp32
    whatever the dtype of the rest (docs/architecture.md §3: bf16 rounding flips top-k sets)."""
    return ".moe.router." in name or ".moe.router_norm." in name


def storage_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype tensor `name` is written or loaded in when the model's dtype is `dtype`."""
    return torch.float32 if is_router_tensor(name) and dtype.itemsize < 4 else dtype


def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical tensor names and shapes for a config (built on the meta device: no memory used)."""
    with torch.device("meta"):
        model = MoETransformer(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def save_artifact(
    dst: str | Path,
    config: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    tokenizer: Tokenizer,
    *,
    provenance: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write an artifact. The directory is written aside and renamed into place, so a failure never
    leaves a half-written DST. Tensors are checked against the config before anything is written."""
    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise ArtifactError(f"{dst} already exists (pass overwrite=True to replace it)")
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

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE))
        tokenizer.save(tmp / TOKENIZER_FILE)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "model": config.to_dict(),
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
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


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
        raise ArtifactError(f'{config_path} is not a moe-serve artifact config ("format" must be "{FORMAT}")')
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
    return manifest, config


def load_artifact(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    verify_checksums: bool = True,
) -> Artifact:
    """Load and validate an artifact: everything serving will use is checked here (config, checksums,
    tokenizer, chat template, quality table, every tensor's name, shape, dtype and values), so that an
    artifact either fails to load with one ArtifactError naming the problem or serves."""
    path = Path(path)
    manifest, config = read_manifest(path)
    for name in (WEIGHTS_FILE, TOKENIZER_FILE):
        if not (path / name).is_file():
            raise ArtifactError(f"{path} has no {name}")
    if verify_checksums:
        check_checksums(path, manifest.get("checksums") or {})
    tokenizer = _read_tokenizer(path / TOKENIZER_FILE, config)
    if config.chat_template is not None:
        _check_chat_template(config.chat_template, path / CONFIG_FILE)
    quality = QualityTable.read(path / QUALITY_FILE) if (path / QUALITY_FILE).is_file() else None
    tensors = _read_tensors(path / WEIGHTS_FILE, config, device, dtype)

    with torch.device("meta"):
        model = MoETransformer(config)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.eval().requires_grad_(False)
    model.prepare()
    return Artifact(path, config, tokenizer, model, manifest.get("provenance") or {}, quality)


def _read_tensors(path: Path, config: ModelConfig, device: str | torch.device, dtype: torch.dtype) -> dict:
    """Every tensor the config describes, with the shape it describes, stored as F32, F16 or BF16, finite."""
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
            check_tensors(config, shapes)
            for name in f.keys():
                dtype_name = f.get_slice(name).get_dtype()
                if dtype_name not in _SAFETENSORS_DTYPES:
                    raise ArtifactError(f"tensor '{name}' has dtype {dtype_name}; artifacts store F32, F16 or BF16")
                tensor = f.get_tensor(name)
                if not torch.isfinite(tensor).all():
                    raise ArtifactError(f"tensor '{name}' in {path.name} holds NaN or infinite values")
                tensors[name] = hugepages.place(tensor, storage_dtype(name, dtype), device)  # one copy
    except ArtifactError:
        raise
    except Exception as exc:  # safetensors raises its own errors for corrupt or truncated files
        raise ArtifactError(f"cannot read {path}: {exc}") from None
    return tensors


# Encoded and decoded at load: a tokenizer that cannot handle ordinary text (a WordLevel model without an
# unknown token, say) fails here rather than in every request.
_TOKENIZER_PROBE = "Hello, world! 0123 naïve café, Ελληνικά, 日本語 🙂\n\ttabs  and  spaces"


def _read_tokenizer(path: Path, config: ModelConfig) -> Tokenizer:
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
        actual = sha256_file(path / name)
        if actual != recorded:
            raise ArtifactError(
                f"checksum mismatch for {name}: config.json records sha256 {recorded[:16]}…, the file "
                f"has {actual[:16]}…"
            )


def check_tensors(config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    expected = expected_tensors(config)
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
