"""Weights stored below fp32 for the CPU kernels: bf16, int8 and int4 (docs/architecture.md §6,
docs/artifact-format.md "Weight formats"). Activations and accumulation stay fp32; the kernels unpack the
weights in registers inside their dot products.

- bf16: the weight rounded to bfloat16 (round to nearest even), [.., N, K].
- int8: groups of GROUP_SIZE consecutive values along K share one fp16 scale d = max|w| / 127; the value
  is round(w / d) in [-127, 127]. data int8 [.., N, K], scales fp16 [.., N, K / 32]. (llama.cpp's Q8_0.)
- int4: groups of 32 share one fp16 scale d = m / -8, where m is the group's value of largest magnitude
  (its sign kept, so that value lands exactly on -8 and the 16 levels cover [-8d, 7d]); the value is
  min(15, round(w / d + 8)), stored as a nibble: byte j of a group holds value j in its low nibble and
  value j + 16 in its high nibble. data uint8 [.., N, K / 2], scales fp16 [.., N, K / 32]. (Q4_0.)

fp16 scales halve the scale bytes against fp32 (int4: 4.5 bits a weight, not 5) at a relative error of
2^-11 on the scale, far under the rounding of the values themselves. `quantize` and `dequantize` here are
the definition; the kernels are tested against `dequantize`.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import torch

from moe_serve.errors import ArtifactError

GROUP_SIZE = 32  # values along K that share a scale (int8, int4)
_FP16_MAX = float(torch.finfo(torch.float16).max)


class WeightFormat(enum.StrEnum):
    """How a weight tensor is stored; FP32 is the plain tensor."""

    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def grouped(self) -> bool:
        return self in (WeightFormat.INT8, WeightFormat.INT4)


PACKED_FORMATS = (WeightFormat.BF16, WeightFormat.INT8, WeightFormat.INT4)
PACKED_FORMAT_NAMES = tuple(f.value for f in PACKED_FORMATS)  # what --weights and the manifest accept

# --cpu-activations: the lowest precision the CPU kernels may round a weight's input to (ONNX Runtime's
# accuracy_level). fp32: the exact mode. bf16: bf16 weights read bf16 activations (kernels/csrc/bf16_dot.h,
# where the CPU has AVX-512 BF16), the other formats fp32. int8: as bf16, and int8 and int4 weights read int8
# activations (int_dot.h). auto: as int8 but for the layer group that moved quality most, attention's
# projections, which keep fp32 (moe_serve.weights.activations_for).
# Each mode's allowed roundings, lowest first (mode_reads takes the first a format has kernels for).
MODE_ROUNDINGS = {"fp32": (), "bf16": ("bf16",), "int8": ("int8", "bf16"), "auto": ("int8", "bf16")}
CPU_ACTIVATIONS = tuple(MODE_ROUNDINGS)
# What a packed weight's input can be rounded to (PackedWeight.activations): the formats with kernels for it.
ACTIVATION_FORMATS = {"fp32": ("bf16", "int8", "int4"), "int8": ("int8", "int4"), "bf16": ("bf16",)}
BF16_CHUNK = 32  # values of K a bf16 dot product takes at a time (bf16_dot.h): K must be a multiple


def mode_reads(fmt: WeightFormat, mode: str) -> str:
    """What weights of `fmt` read under --cpu-activations `mode` where nothing else decides (the layer-group
    rule of `auto` and the CPU's instructions: weights.activations_for): the lowest precision `mode` allows
    that `fmt` has kernels for."""
    for kind in MODE_ROUNDINGS[mode]:
        if fmt.value in ACTIVATION_FORMATS[kind]:
            return kind
    return "fp32"


def weights_label(fmt: str, activations: str = "fp32") -> str:
    """What a quality row or a comparison names weights of `fmt` read with `activations` by: the format alone
    for fp32 activations ("int8"), else FORMAT:ACTIVATIONS ("int8:int8")."""
    return fmt if activations == "fp32" else f"{fmt}:{activations}"


# What weights_label accepts, for messages (one owner): parse_weights_label's rule in words.
WEIGHTS_LABELS = (
    f"{', '.join(PACKED_FORMAT_NAMES)}, each optionally with :ACTIVATIONS that its kernels have (int8 and int4: "
    ":int8 or :auto; bf16: :bf16, :int8 or :auto)"
)


def parse_weights_label(label: str) -> tuple[str, str] | None:
    """(format, activations) of a weights_label, or None where it names no packed format and activations
    with kernels for it (mode_reads: int8 and auto for int8 and int4 weights; bf16, int8 and auto for bf16)."""
    fmt, colon, activations = label.partition(":")
    activations = activations if colon else "fp32"
    if fmt not in PACKED_FORMAT_NAMES or activations not in CPU_ACTIVATIONS:
        return None
    if activations != "fp32" and mode_reads(WeightFormat(fmt), activations) == "fp32":
        return None
    return fmt, activations


def packed_format(name: object) -> WeightFormat | None:
    """The packed format of this name, or None (each caller refuses it in its own error type, naming
    PACKED_FORMAT_NAMES)."""
    return WeightFormat(name) if name in PACKED_FORMAT_NAMES else None


class PackError(ArtifactError):
    """A tensor that cannot be stored in the requested format (its message names why)."""


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A weight [.., N, K] in a packed format: the kernels' operand in place of a float tensor."""

    format: WeightFormat
    data: torch.Tensor  # bf16 [.., N, K] | int8 [.., N, K] | uint8 [.., N, K / 2] (tiled: see `tile`)
    scales: torch.Tensor | None  # fp16 [.., N, K / GROUP_SIZE] for int8 and int4; None for bf16
    shape: tuple[int, ...]  # the logical shape [.., N, K]
    # What the CPU kernels round this weight's input to before the products (ACTIVATION_FORMATS): fp32 (nothing:
    # the exact mode), int8 blocks (int8 and int4 weights: kernels/csrc/int_dot.h) or bf16 (bf16 weights:
    # bf16_dot.h), as --cpu-activations decided (moe_serve.weights.activations_for).
    activations: str = "fp32"
    tiled: bool = False  # data and scales in the integer kernels' tiles of 8 rows (`tile`)

    def __post_init__(self) -> None:
        if self.format.value not in ACTIVATION_FORMATS.get(self.activations, ()):
            raise PackError(f"{self.format.value} weights cannot take {self.activations} activations")
        if self.tiled and self.activations != "int8":
            raise PackError("tiles of 8 rows are the int8-activation kernels' layout")

    def with_activations(self, activations: str) -> PackedWeight:
        """This weight read with `activations` (fp32, int8 or bf16) where its format has kernels for them, else
        with fp32 ones: int8 tiled (`tile`: a copy, after which this one can be freed) where its rows are a
        multiple of 8; bf16 where K is a multiple of BF16_CHUNK."""
        if activations not in ACTIVATION_FORMATS:
            raise PackError(f"unknown activations {activations!r}: {', '.join(ACTIVATION_FORMATS)}")
        if activations == self.activations:
            return self
        base = dataclasses.replace(untile(self), activations="fp32")
        if activations == "fp32" or self.format.value not in ACTIVATION_FORMATS[activations]:
            return base
        if activations == "bf16":
            return dataclasses.replace(base, activations="bf16") if self.shape[-1] % BF16_CHUNK == 0 else base
        weight = dataclasses.replace(base, activations="int8")
        return tile(weight) if self.shape[-2] % TILE_ROWS == 0 else weight

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.scales.nbytes if self.scales is not None else 0)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)

    def rows(self, start: int, stop: int) -> PackedWeight:
        """Rows [start, stop) of the last-but-one dimension (output features): a view, no copy (tiled: a copy
        of them untiled, unless both ends are multiples of 8)."""
        shape = (*self.shape[:-2], stop - start, self.shape[-1])
        if self.tiled:
            if start % TILE_ROWS or stop % TILE_ROWS:
                return untile(self).rows(start, stop)
            assert self.scales is not None
            tiles = slice(start // TILE_ROWS, stop // TILE_ROWS)
            return dataclasses.replace(
                self, data=self.data[..., tiles, :, :], scales=self.scales[..., tiles, :, :], shape=shape
            )
        scales = self.scales[..., start:stop, :] if self.scales is not None else None
        return dataclasses.replace(self, data=self.data[..., start:stop, :], scales=scales, shape=shape)

    @staticmethod
    def cat_rows(parts: list[PackedWeight]) -> PackedWeight:
        """The parts stacked along output features (a fused projection): one contiguous copy."""
        first = parts[0]
        if any(
            p.format is not first.format
            or p.shape[:-2] != first.shape[:-2]
            or p.shape[-1] != first.shape[-1]
            or p.activations != first.activations
            for p in parts
        ):
            raise PackError("fused projections must share their format, activation precision and input features")
        if not all(p.tiled for p in parts):  # (tiled parts stay tiled, stacked by tiles of 8 rows)
            parts = [untile(p) for p in parts]
        dim = -3 if parts[0].tiled else -2
        data = torch.cat([p.data for p in parts], dim=dim)
        scales = torch.cat([p.scales for p in parts], dim=dim) if first.scales is not None else None  # type: ignore[misc]
        rows = sum(p.shape[-2] for p in parts)
        return dataclasses.replace(parts[0], data=data, scales=scales, shape=(*first.shape[:-2], rows, first.shape[-1]))

    def stored(self, name: str) -> dict[str, torch.Tensor]:
        """The tensors an artifact stores for weight `name` (see docs/artifact-format.md)."""
        if self.tiled:
            return untile(self).stored(name)
        if self.format is WeightFormat.BF16:
            return {name: self.data}
        assert self.scales is not None
        return {f"{name}.qdata": self.data, f"{name}.scales": self.scales}


def packed_shapes(shape: tuple[int, ...], fmt: WeightFormat) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """suffix -> (shape, dtype) of what `fmt` stores for a weight of logical `shape` ("" is the weight's
    own name; ".qdata" and ".scales" follow it)."""
    *lead, k = shape
    if fmt is WeightFormat.BF16:
        return {"": (tuple(shape), torch.bfloat16)}
    groups = k // GROUP_SIZE
    data = ((*lead, k), torch.int8) if fmt is WeightFormat.INT8 else ((*lead, k // 2), torch.uint8)
    return {".qdata": data, ".scales": ((*lead, groups), torch.float16)}


def check_packable(name: str, shape: tuple[int, ...], fmt: WeightFormat) -> str | None:
    """Why weight `name` of `shape` cannot be stored in `fmt` (None: it can)."""
    if fmt.grouped and shape[-1] % GROUP_SIZE:
        return f"'{name}' has {shape[-1]} input features, not a multiple of the group size {GROUP_SIZE}"
    return None


def quantize(weight: torch.Tensor, fmt: WeightFormat, name: str = "weight") -> PackedWeight:
    """A float weight [.., N, K] -> its packed form (computed in fp32, on the weight's device)."""
    fmt = WeightFormat(fmt)
    if fmt is WeightFormat.FP32:
        raise PackError("fp32 is the unpacked format: keep the tensor")
    reason = check_packable(name, tuple(weight.shape), fmt)
    if reason is not None:
        raise PackError(reason)
    w = weight.detach().float()
    if not torch.isfinite(w).all():
        raise PackError(f"'{name}' holds NaN or infinite values")
    shape = tuple(w.shape)
    if fmt is WeightFormat.BF16:
        return PackedWeight(fmt, w.to(torch.bfloat16).contiguous(), None, shape)
    groups = w.reshape(*shape[:-1], shape[-1] // GROUP_SIZE, GROUP_SIZE)  # [.., N, G, 32]
    if fmt is WeightFormat.INT8:
        scale = groups.abs().amax(-1) / 127.0
    else:  # the value of largest magnitude, sign kept, maps to -8
        extreme = groups.gather(-1, groups.abs().argmax(-1, keepdim=True)).squeeze(-1)
        scale = extreme / -8.0
    if scale.abs().max() > _FP16_MAX:
        raise PackError(f"'{name}' has values too large for fp16 group scales (largest scale {scale.abs().max():.3g})")
    scale16 = scale.to(torch.float16)
    d = scale16.float()[..., None]  # quantize against the scale as stored, so dequantize inverts it
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    if fmt is WeightFormat.INT8:
        q = torch.round(groups * inverse).clamp(-127, 127).to(torch.int8)
        return PackedWeight(fmt, q.reshape(shape).contiguous(), scale16.contiguous(), shape)
    q = torch.round(groups * inverse + 8.0).clamp(0, 15).to(torch.uint8)  # [.., G, 32]
    nibbles = q[..., :16] | (q[..., 16:] << 4)  # [.., G, 16]
    data = nibbles.reshape(*shape[:-1], shape[-1] // 2).contiguous()
    return PackedWeight(fmt, data, scale16.contiguous(), shape)


def dequantize(packed: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight a packed one stands for: the reference every kernel is tested against."""
    packed = untile(packed)
    if packed.format is WeightFormat.BF16:
        return packed.data.to(dtype)
    assert packed.scales is not None
    shape = packed.shape
    values = integer_values(packed).reshape(*shape[:-1], shape[-1] // GROUP_SIZE, GROUP_SIZE).float()
    return (values * packed.scales.float()[..., None]).reshape(shape).to(dtype)


def integer_values(packed: PackedWeight) -> torch.Tensor:
    """An int8 or int4 weight's integer values [.., N, K] (int8; int4: its nibble less 8), before their scales."""
    packed = untile(packed)
    shape = packed.shape
    if packed.format is WeightFormat.INT8:
        return packed.data
    assert packed.format is WeightFormat.INT4
    nibbles = packed.data.reshape(*shape[:-1], shape[-1] // GROUP_SIZE, GROUP_SIZE // 2)
    low, high = (nibbles & 0xF).to(torch.int8), (nibbles >> 4).to(torch.int8)
    return (torch.cat([low, high], dim=-1) - 8).reshape(shape)


# ---- tiles of 8 rows: the int8-activation kernels' layout (kernels/csrc/int_dot.h) -----------------------

TILE_ROWS = 8
STEP_BYTES = 4  # bytes of one row a step holds: one 32-bit lane


def tile(packed: PackedWeight) -> PackedWeight:
    """An int8 or int4 weight [.., N, K] (N a multiple of 8) in tiles of 8 rows: data [.., N / 8, K / 32, T]
    holding, per tile and group of 32 values, the 8 rows' bytes of the group interleaved by 4 (step s: bytes
    4s..4s+3 of row 0, then of row 1, .., row 7; T = 256 for int8, 128 for int4), and scales [.., N / 8, K / 32,
    8]. The kernels' result is the same bits as on the rows as stored; this only orders the bytes for them."""
    if packed.tiled:
        return packed
    assert packed.scales is not None and packed.shape[-2] % TILE_ROWS == 0
    *lead, n, k = packed.shape
    group_bytes = packed.data.shape[-1] * GROUP_SIZE // k  # 32 (int8) or 16 (int4)
    steps = group_bytes // STEP_BYTES
    data = packed.data.reshape(*lead, n // TILE_ROWS, TILE_ROWS, k // GROUP_SIZE, steps, STEP_BYTES)
    data = data.movedim(-4, -2).reshape(*lead, n // TILE_ROWS, k // GROUP_SIZE, TILE_ROWS * group_bytes)
    scales = packed.scales.reshape(*lead, n // TILE_ROWS, TILE_ROWS, k // GROUP_SIZE).movedim(-2, -1)
    return dataclasses.replace(packed, data=data.contiguous(), scales=scales.contiguous(), tiled=True)


def untile(packed: PackedWeight) -> PackedWeight:
    """A weight's rows as stored (`tile` undone; an untiled weight as it is)."""
    if not packed.tiled:
        return packed
    assert packed.scales is not None
    *lead, n, k = packed.shape
    tiles, groups, tile_bytes = packed.data.shape[-3:]
    steps = tile_bytes // TILE_ROWS // STEP_BYTES
    data = packed.data.reshape(*lead, tiles, groups, steps, TILE_ROWS, STEP_BYTES).movedim(-2, -4)
    data = data.reshape(*lead, n, tile_bytes // TILE_ROWS * groups)
    scales = packed.scales.movedim(-1, -2).reshape(*lead, n, groups)
    return dataclasses.replace(packed, data=data.contiguous(), scales=scales.contiguous(), tiled=False)


def from_stored(fmt: WeightFormat, tensors: dict[str, torch.Tensor], shape: tuple[int, ...]) -> PackedWeight:
    """A packed weight from the tensors an artifact stores for it (suffix -> tensor, as `packed_shapes`)."""
    if fmt is WeightFormat.BF16:
        return PackedWeight(fmt, tensors[""], None, shape)
    return PackedWeight(fmt, tensors[".qdata"], tensors[".scales"], shape)
