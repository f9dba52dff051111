"""Position encodings that are computed, not stored in the artifact: rotary (HF rotate-half convention) and
the Transformer-XL sinusoidal relative embedding. The model computes their tables once, after loading
(see MoETransformer.prepare), for every position its context allows."""

from __future__ import annotations

import functools
import math

import torch

from moe_serve.kernels.rotary import apply_rotary
from moe_serve.model_config import RopeScaling

__all__ = ["apply_rotary", "rotary_cos_sin", "rotary_inv_freq", "rotary_tables", "sinusoid_relative"]


def rotary_inv_freq(
    dim: int, theta: float, scaling: RopeScaling | None, device: torch.device
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the cos/sin scale, exactly as Hugging Face computes them."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq, 1.0
    if scaling.type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if scaling.type == "longrope":  # the short regime (RopeScaling), in transformers' order of operations
        assert scaling.short_factor is not None and scaling.attention_factor is not None
        factors = torch.tensor(scaling.short_factor, dtype=torch.float32, device=device)
        return 1.0 / (factors * theta**exponents), scaling.attention_factor
    return _yarn(dim, theta, scaling, exponents)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's scaling, in transformers' order of operations."""
    assert s.original_max_position_embeddings is not None and s.low_freq_factor and s.high_freq_factor
    original = s.original_max_position_embeddings
    low_wavelen, high_wavelen = original / s.low_freq_factor, original / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, theta: float, s: RopeScaling, exponents: torch.Tensor) -> tuple[torch.Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
        else:
            attention_factor = mscale(s.factor)
    original = s.original_max_position_embeddings
    assert original is not None  # RopeScaling requires it for yarn

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=exponents.device) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta**exponents
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


@functools.lru_cache(maxsize=8)
def rotary_tables(
    max_len: int, dim: int, theta: float, scaling: RopeScaling | None, rotary_dim: int | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_cos_sin for positions 0 .. max_len - 1, built once per distinct set of arguments in the process and
    shared, read-only, by every layer that asks (a model's layers all do: 32 layers of 32,768 positions by 128
    would otherwise hold 32 copies of 34 MB)."""
    return rotary_cos_sin(torch.arange(max_len, device=device), dim, theta, scaling, rotary_dim)


def rotary_cos_sin(
    positions: torch.Tensor, dim: int, theta: float, scaling: RopeScaling | None = None, rotary_dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [*positions.shape, dim] in fp32. rotary_dim < dim (ModelConfig.rotary_dim): pairs (j,
    j + dim/2) for j < rotary_dim/2 rotate at the frequencies of a rotary_dim-wide rotation; the other pairs
    pass through (cos 1, sin 0, unscaled)."""
    rotary_dim = rotary_dim or dim
    inv_freq, scale = rotary_inv_freq(rotary_dim, theta, scaling, positions.device)
    freqs = positions.float()[..., None] * inv_freq  # [..., rotary_dim/2]
    half_cos, half_sin = freqs.cos() * scale, freqs.sin() * scale
    if rotary_dim < dim:
        through = freqs.new_zeros(*freqs.shape[:-1], (dim - rotary_dim) // 2)
        half_cos, half_sin = torch.cat((half_cos, through + 1), dim=-1), torch.cat((half_sin, through), dim=-1)
    return torch.cat((half_cos, half_cos), dim=-1), torch.cat((half_sin, half_sin), dim=-1)


def sinusoid_relative(distances: torch.Tensor, dim: int) -> torch.Tensor:
    """Transformer-XL relative embedding R[d] = [sin(d w), cos(d w)] for each distance d: [R, dim]."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0.0, dim, 2.0, device=distances.device) / dim))
    angles = distances.float()[:, None] * inv_freq[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)
