"""The benchmark models: Mixtral-format checkpoints with random weights, built with transformers' own
classes (so every engine loads the same weights) and exported to moe-serve artifacts; cached on disk.

- tiny: hidden 256, 4 layers, 8 experts, k = 2, vocabulary 1,000 (overhead-bound);
- medium: hidden 1,024, 8 layers, 16 experts of 1,024, k = 2, vocabulary 32,000, ~0.49 B parameters
  (bandwidth-bound).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CACHE = Path(os.environ.get("BENCH_CACHE", Path(__file__).resolve().parent / ".cache"))  # --cache

PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    "medium": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        num_local_experts=16,
        num_experts_per_tok=2,
    ),
}


@dataclass(frozen=True, slots=True)
class BenchModel:
    name: str
    hf_dir: Path  # transformers / vLLM load this
    artifact: Path  # moe-serve loads this
    config: dict
    cache: Path  # the benchmark cache it was built in

    @property
    def num_experts(self) -> int:
        return self.config["num_local_experts"]

    def ks(self, spec: str) -> list[int]:
        """Experts per token from a comma-separated list in which N stands for all of this model's experts."""
        return [self.num_experts if k.strip().upper() == "N" else int(k) for k in spec.split(",")]

    def decode_bytes(self, k: int, context: int = 96, bytes_per_value: int = 4) -> int:
        """Bytes one batch-1 decode step must read at k: the weights it uses plus the KV cache it attends."""
        c = self.config
        d, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
        head_dim = d // c["num_attention_heads"]
        attention = d * d * 2 + 2 * d * c["num_key_value_heads"] * head_dim  # q, o, k, v
        per_layer = attention + d * c["num_local_experts"] + k * 3 * d * i + 2 * d  # router, k experts, norms
        kv = 2 * c["num_key_value_heads"] * head_dim * context
        return bytes_per_value * (layers * (per_layer + kv) + c["vocab_size"] * d + d)  # + lm head, final norm

    def packed_decode_bytes(self, k: int, bits: float, context: int = 96) -> float:
        """decode_bytes with the packable weights (attention, the k experts, the LM head: moe_serve.weights) at
        `bits` per weight, scales included; the router, norms and the fp32 KV cache as they are."""
        c = self.config
        d, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
        head_dim = d // c["num_attention_heads"]
        packable = layers * (d * d * 2 + 2 * d * c["num_key_value_heads"] * head_dim + k * 3 * d * i)
        packable += c["vocab_size"] * d
        return self.decode_bytes(k, context) - 4 * packable + bits / 8 * packable


def build(name: str, cache: Path) -> BenchModel:
    """The preset's checkpoint and artifact under cache/ (built once; seed 0)."""
    config = PRESETS[name]
    root = cache / name
    hf_dir, artifact = root / "hf", root / "artifact"
    if not (artifact / "config.json").is_file():
        import torch
        from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast

        from moe_serve.exporters.base import ExportOptions
        from moe_serve.exporters.hf import export_hf
        from moe_serve.tokenizer import byte_level_tokenizer

        torch.manual_seed(0)
        hf_config = MixtralConfig(
            **config, bos_token_id=None, eos_token_id=None, pad_token_id=None, max_position_embeddings=4096
        )
        MixtralForCausalLM(hf_config).eval().save_pretrained(hf_dir)
        PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer()).save_pretrained(hf_dir)
        export_hf(hf_dir, artifact, ExportOptions(progress=False, overwrite=True))
    return BenchModel(name, hf_dir, artifact, config, cache)
