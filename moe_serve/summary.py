"""A summary of an artifact: architecture, MoE spec, and parameter counts (total, and active per token
at each k) computed from the config alone, without loading weights."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from moe_serve.artifact import expected_tensors, read_manifest, weights_spec
from moe_serve.router_registry import router_class


def summarize(path: Path) -> dict[str, Any]:
    manifest, config = read_manifest(path)
    shapes = expected_tensors(config)
    total = sum(math.prod(s) for s in shapes.values())
    summary: dict[str, Any] = {
        "path": str(path),
        "format_version": manifest["format_version"],
        "task": config.task,
        "weights": _weights(manifest, config),
        "architecture": {
            "layers": config.num_layers,
            "hidden_size": config.hidden_size,
            "heads": config.num_heads,
            "kv_heads": config.num_kv_heads,
            "head_dim": config.head_dim,
            "position": config.position,
            "norm": f"{config.norm} ({config.norm_position})",
            "vocab_size": config.vocab_size,
            "max_position_embeddings": config.max_position_embeddings,
            "dense_ffn": f"{config.ffn.kind} {config.ffn.activation} x{config.ffn.intermediate_size}",
        },
        "parameters": {"total": total},
        "provenance": manifest.get("provenance", {}),
    }
    if config.latent_attention is not None:  # MLA: head_dim above is its rope part; the cache holds latents
        mla = config.latent_attention
        summary["architecture"]["latent_attention"] = {
            "q_lora_rank": mla.q_lora_rank,
            "kv_lora_rank": mla.kv_lora_rank,
            "qk_nope_head_dim": mla.qk_nope_head_dim,
            "qk_rope_head_dim": mla.qk_rope_head_dim,
            "v_head_dim": mla.v_head_dim,
            "cached_values_per_token_per_layer": mla.cache_width,
            "per_head_kv_values_per_token_per_layer": mla.full_kv_width(config.num_heads),
        }
    if config.classifier is not None:
        summary["labels"] = list(config.classifier.labels)
    moe = config.moe
    if moe is not None:
        per_expert = sum(math.prod(s[1:]) for n, s in shapes.items() if f"layers.{moe.layers[0]}.moe.experts." in n)
        idle = per_expert * len(moe.layers)  # parameters of one expert slot across all MoE layers
        # HyperMoE: one adapter per token per layer out of its table of one per selected set.
        per_adapter = sum(math.prod(s[1:]) for n, s in shapes.items() if f"layers.{moe.layers[0]}.moe.hyper." in n)
        idle_adapters = (moe.num_patterns - 1) * per_adapter * len(moe.layers) if moe.hyper_expert else 0
        active = {}
        for k in range(moe.min_k, moe.max_k + 1):
            # A merging kind (soft_merge) applies one merged expert per token whatever k is (k are averaged first).
            used = 1 if router_class(moe.router.kind).merges_experts else k
            active[str(k)] = total - (moe.num_experts - used) * idle - idle_adapters
        summary["moe"] = {
            "layers": list(moe.layers),
            "num_experts": moe.num_experts,
            "expert": f"{moe.expert.kind} {moe.expert.activation} x{moe.expert.intermediate_size}",
            "router": moe.router.describe(),
            "experts_per_token": {"default": moe.default_k, "min": moe.min_k, "max": moe.max_k},
            "shared_expert": None
            if moe.shared_expert is None
            else f"{moe.shared_expert.kind} x{moe.shared_expert.intermediate_size}"
            + (" (sigmoid-gated)" if moe.shared_expert_gate else ""),
            "hyper_expert": None
            if moe.hyper_expert is None
            else f"{moe.hyper_expert.kind} x{moe.hyper_expert.intermediate_size}, one per selected set "
            f"({moe.num_patterns})",
        }
        summary["parameters"]["per_expert_per_layer"] = per_expert
        summary["parameters"]["active_per_token"] = active
    return summary


def _weights(manifest: dict[str, Any], config: Any) -> dict[str, Any]:
    """The storage of the weights: floats, or a packed format and how many weights use it."""
    spec = weights_spec(manifest, config)
    if spec is None:
        return {"format": "float"}
    return {"format": spec.format.value, "packed": len(spec.packed)}


def format_summary(summary: dict[str, Any]) -> str:
    weights = summary["weights"]
    packed = f", {weights['format']} weights ({weights['packed']} packed)" if "packed" in weights else ""
    lines = [f"{summary['path']}  ({summary['task']}, format v{summary['format_version']}{packed})"]
    arch = summary["architecture"]
    lines.append(
        f"  {arch['layers']} layers, hidden {arch['hidden_size']}, {arch['heads']} heads "
        f"({arch['kv_heads']} kv, dim {arch['head_dim']}), "
        f"{arch['position']} positions, {arch['norm']}, vocab {arch['vocab_size']}, "
        f"context {arch['max_position_embeddings']}"
    )
    mla = arch.get("latent_attention")
    if mla:
        lines.append(
            f"  latent attention: kv_lora_rank {mla['kv_lora_rank']}, q_lora_rank {mla['q_lora_rank']}, per head "
            f"nope {mla['qk_nope_head_dim']} + rope {mla['qk_rope_head_dim']}, v {mla['v_head_dim']}; the KV cache "
            f"holds {mla['cached_values_per_token_per_layer']} values per token per layer (per-head keys and values: "
            f"{mla['per_head_kv_values_per_token_per_layer']})"
        )
    lines.append(f"  dense FFN: {arch['dense_ffn']}")
    if "labels" in summary:
        lines.append(f"  labels: {', '.join(summary['labels'])}")
    moe = summary.get("moe")
    if moe:
        k = moe["experts_per_token"]
        lines.append(
            f"  MoE layers {moe['layers']}: {moe['num_experts']} experts ({moe['expert']}), router {moe['router']}"
        )
        lines.append(f"  experts_per_token: default {k['default']}, allowed {k['min']}..{k['max']}")
        if moe["shared_expert"]:
            lines.append(f"  shared expert: {moe['shared_expert']}")
        if moe["hyper_expert"]:
            lines.append(f"  HyperExpert: {moe['hyper_expert']}")
    params = summary["parameters"]
    lines.append(f"  parameters: {params['total']:,} total")
    for k, count in params.get("active_per_token", {}).items():
        lines.append(f"    active per token at k={k}: {count:,} ({100 * count / params['total']:.1f}%)")
    provenance = summary.get("provenance") or {}
    if provenance:
        lines.append("  provenance: " + ", ".join(f"{key}={value}" for key, value in provenance.items()))
    return "\n".join(lines)
