"""`moe-serve quantize`: an artifact of float weights -> a new artifact whose packable weights (moe_serve.weights)
are stored as bf16, int8 or int4 (moe_serve.kernels.packed). Config, tokenizer and provenance carry over; the
quality table does not (it measured the float weights: `moe-serve eval --write-artifact` measures the new one)."""

from __future__ import annotations

from pathlib import Path

from moe_serve.artifact import (
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    check_checksums,
    is_artifact_dir,
    read_manifest,
    read_tensors,
    read_tokenizer,
    save_artifact,
    weights_spec,
)
from moe_serve.errors import ArtifactError
from moe_serve.kernels.packed import PACKED_FORMAT_NAMES, WeightFormat, packed_format
from moe_serve.output_dir import check_destination


def quantize_artifact(
    src: str | Path, dst: str | Path, weights: str | WeightFormat, *, overwrite: bool = False, progress: bool = True
) -> Path:
    """Write DST: SRC with its packable weights stored in `weights` (bf16, int8, int4). Every input the
    artifact loader refuses is refused here in one line (ArtifactError), and DST is checked before any work."""
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
    check_destination(dst, overwrite=overwrite, is_ours=is_artifact_dir, sources=(src,), error=ArtifactError)
    check_checksums(src, manifest.get("checksums") or {})
    tokenizer = read_tokenizer(src / TOKENIZER_FILE, config)
    if progress:
        print(f"reading {src.name} ...", flush=True)
    state, _ = read_tensors(src / WEIGHTS_FILE, config, "cpu", None, None)  # as stored, finite, the right shapes
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
        tokenizer,
        provenance=provenance,
        weights=fmt,
        overwrite=overwrite,
        sources=(src,),
    )
