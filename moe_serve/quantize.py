"""`moe-serve quantize`: an artifact of float weights -> a new artifact whose packable weights (moe_serve.weights)
are stored as bf16, int8 or int4 (moe_serve.kernels.packed). Config, tokenizer and provenance carry over; the
quality table does not (it measured the float weights: `moe-serve eval --write-artifact` measures the new one)."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open
from tqdm import tqdm

from moe_serve.artifact import TOKENIZER_FILE, WEIGHTS_FILE, check_checksums, read_manifest, save_artifact, weights_spec
from moe_serve.errors import ArtifactError
from moe_serve.kernels.packed import PACKED_FORMAT_NAMES, WeightFormat, packed_format
from moe_serve.tokenizer import Tokenizer


def quantize_artifact(
    src: str | Path, dst: str | Path, weights: str | WeightFormat, *, overwrite: bool = False, progress: bool = True
) -> Path:
    """Write DST: SRC with its packable weights stored in `weights` (bf16, int8, int4)."""
    src, dst = Path(src), Path(dst)
    fmt = packed_format(weights)
    if fmt is None:
        raise ArtifactError(f"--weights must be one of {', '.join(PACKED_FORMAT_NAMES)}; got {weights!r}")
    manifest, config = read_manifest(src)
    spec = weights_spec(manifest, config, src)
    if spec is not None:
        raise ArtifactError(
            f"{src} already stores {spec.format.value} weights; quantize from the float artifact it came from"
        )
    if dst.resolve() == src.resolve():
        raise ArtifactError("DST must differ from SRC (the source artifact is never changed in place)")
    check_checksums(src, manifest.get("checksums") or {})
    with safe_open(str(src / WEIGHTS_FILE), framework="pt", device="cpu") as f:
        names = list(f.keys())
        state = {name: f.get_tensor(name) for name in tqdm(names, desc=f"reading {src.name}", disable=not progress)}
    provenance = {
        **(manifest.get("provenance") or {}),
        "quantized_from": {
            "path": str(src),
            "weights_sha256": manifest["checksums"][WEIGHTS_FILE],
            "format": fmt.value,
        },
    }
    if progress:
        print(f"packing {len(state)} tensors as {fmt.value} ...", flush=True)
    return save_artifact(
        dst,
        config,
        state,  # the tensors that stay as they are keep their stored dtype
        Tokenizer.from_file(src / TOKENIZER_FILE),
        provenance=provenance,
        weights=fmt,
        overwrite=overwrite,
    )
