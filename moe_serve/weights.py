"""Which of a model's weights an artifact may store packed (bf16, int8, int4: moe_serve.kernels.packed), the
manifest section that records it, and putting packed weights into a loaded model (docs/artifact-format.md,
"Weight formats").

A weight is packable when the runtime reads it only through the kernels' linear and MoE operands
(`ops.linear`, `ops.moe_experts`): attention projections, dense FFNs, shared experts, expert banks and an
untied LM head. Everything else stays as it is: router weights and norms (router math is fp32: a quantized
router flips top-k sets), embeddings (a lookup, not a product), classifier heads, Transformer-XL's
positional projection (applied once at load), HyperMoE's adapter table, SMEAR's banks (their parameters
are averaged per input, so they are read as floats), the output projection of a layer whose router
reads attention (it reads W_O's columns per head) and latent attention's kv_b_proj (read per head as the
absorbed key and value maps, moe_serve/layers/latent_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moe_serve.errors import ArtifactError
from moe_serve.kernels.packed import (
    GROUP_SIZE,
    PACKED_FORMAT_NAMES,
    PackedWeight,
    WeightFormat,
    check_packable,
    mode_reads,
    packed_format,
    quantize,
)
from moe_serve.layers.ffn import linear_shapes
from moe_serve.model_config import ModelConfig
from moe_serve.router_registry import router_class

MANIFEST_KEY = "weights"


@dataclass(frozen=True, slots=True)
class WeightsSpec:
    """The manifest's "weights" section: the format and which weights are stored in it."""

    format: WeightFormat
    packed: tuple[str, ...]  # weight names (as the model names them) stored packed
    group_size: int = GROUP_SIZE

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": self.format.value, "packed": list(self.packed)}
        if self.format.grouped:
            out["group_size"] = self.group_size
        return out

    @classmethod
    def parse(cls, data: Any, config: ModelConfig, where: str) -> WeightsSpec:
        """The section as written, checked against the config: a known packed format, the group size this
        runtime reads, no other keys, and exactly the weights this runtime packs in that format (what
        `pack` writes): a partial list would leave fused projections half packed."""
        if not isinstance(data, dict):
            raise ArtifactError(f'{where}: "{MANIFEST_KEY}" must be an object')
        fmt = packed_format(data.get("format"))
        if fmt is None:
            formats = ", ".join(PACKED_FORMAT_NAMES)
            raise ArtifactError(f"{where}: weights format must be one of {formats}; got {data.get('format')!r}")
        keys = {"format", "packed", "group_size"} if fmt.grouped else {"format", "packed"}
        unknown = sorted(set(data) - keys)
        if unknown:
            raise ArtifactError(f"{where}: the weights section has no field {unknown[0]!r} for {fmt.value} weights")
        group = data.get("group_size", GROUP_SIZE)
        if fmt.grouped and group != GROUP_SIZE:
            raise ArtifactError(
                f"{where}: weights group_size {group!r} is not supported; this runtime reads {GROUP_SIZE}"
            )
        packed = data.get("packed")
        if not (isinstance(packed, list) and all(isinstance(n, str) for n in packed)):
            raise ArtifactError(f'{where}: weights "packed" must be a list of tensor names')
        allowed = packable_weights(config, fmt)
        for i, name in enumerate(packed):
            if name not in allowed:
                raise ArtifactError(
                    f"{where}: weight '{name}' cannot be stored as {fmt.value} (not a packable weight of this model)"
                )
            if name in packed[:i]:
                raise ArtifactError(f"{where}: weights \"packed\" lists '{name}' twice")
        missing = [name for name in allowed if name not in packed]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ArtifactError(
                f"{where}: weights \"packed\" must list every packable weight of this model; '{missing[0]}' is "
                f"missing{more}"
            )
        return cls(fmt, tuple(packed), GROUP_SIZE)


def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical tensor names and shapes for a config (built on the meta device: no memory used)."""
    from moe_serve.models import MoETransformer

    with torch.device("meta"):
        model = MoETransformer(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def packable_weights(config: ModelConfig, fmt: WeightFormat) -> dict[str, tuple[int, ...]]:
    """name -> logical shape of every weight of `config` that may be stored in `fmt` (see the module doc)."""
    names = []
    for i in range(config.num_layers):
        attn = f"layers.{i}.attn"
        if config.latent_attention is not None:  # kv_b_proj stays float: it is read per head (Wuk, Wuv)
            q = ("q_proj",) if config.latent_attention.q_lora_rank is None else ("q_a_proj", "q_b_proj")
            names += [f"{attn}.{name}.weight" for name in (*q, "kv_a_proj")]
        else:
            names += [f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"]
        moe = config.moe if config.is_moe_layer(i) else None
        kind = router_class(moe.router.kind) if moe is not None else None
        if kind is None or not kind.reads_attention:
            names.append(f"{attn}.o_proj.weight")
        if moe is None:
            names += [f"layers.{i}.ffn.{name}.weight" for name in linear_shapes(config.ffn, config.hidden_size)]
            continue
        assert kind is not None
        if not kind.merges_experts:
            names += [f"layers.{i}.moe.experts.{name}.weight" for name in linear_shapes(moe.expert, config.hidden_size)]
        if moe.shared_expert is not None:
            shared = linear_shapes(moe.shared_expert, config.hidden_size)
            names += [f"layers.{i}.moe.shared_expert.{name}.weight" for name in shared]
    if config.task == "causal_lm" and not config.tie_word_embeddings:
        names.append("lm_head.weight")
    shapes = expected_tensors(config)
    return {name: shapes[name] for name in names if check_packable(name, shapes[name], fmt) is None}


def pack(
    config: ModelConfig, state: dict[str, torch.Tensor], fmt: WeightFormat
) -> tuple[dict[str, torch.Tensor], WeightsSpec]:
    """A float state dict -> the tensors an artifact stores in `fmt` (packed weights under their stored
    names, the rest unchanged) and the manifest section."""
    packable = packable_weights(config, fmt)
    out: dict[str, torch.Tensor] = {}
    packed: list[str] = []
    for name, tensor in state.items():
        if name in packable:
            out.update(quantize(tensor, fmt, name).stored(name))
            packed.append(name)
        else:
            out[name] = tensor
    return out, WeightsSpec(fmt, tuple(packed))


def activations_for(name: str, fmt: WeightFormat, mode: str, bf16_dot: bool) -> str:
    """What packed weight `name` of `fmt` reads under --cpu-activations `mode` (packed.CPU_ACTIVATIONS):
    packed.mode_reads's precision, except that under auto attention's projections keep fp32 and that bf16
    needs the CPU's bf16 dot products (`bf16_dot`: AVX-512 BF16; fp32 without). Measured on the demos
    (docs/weight-formats.md), at k = 1, KL from fp32 activations in nats a token: with int8 activations the
    attention group alone 0.0010-0.0014 (all groups 0.0011-0.0016), the rest together 0.0002-0.0008, against a
    gate of 0.001; with bf16 activations attention alone 0.00054 on shakespeare-smoe (all 0.00058), the rest
    0.00035, against a gate of 0.0005."""
    kind = mode_reads(fmt, mode)
    if mode == "auto" and ".attn." in name:
        return "fp32"
    if kind == "bf16" and not bf16_dot:
        return "fp32"
    return kind


def install(model: nn.Module, weights: dict[str, PackedWeight]) -> None:
    """Put each packed weight where the model's float parameter of that name was (before `prepare`)."""
    for name, packed in weights.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        del module._parameters[attr]  # a PackedWeight is no Parameter: it becomes a plain attribute
        setattr(module, attr, packed)


def packed_refusal(spec: WeightsSpec, runtime: str) -> str:
    """Why `runtime` (the ONNX export, the vLLM plugin) refuses an artifact of packed weights."""
    return (
        f"this artifact stores {spec.format.value} weights (moe-serve quantize), which only moe-serve's CPU kernels "
        f"read; {runtime} takes artifacts of float weights: use the artifact it was quantized from"
    )
