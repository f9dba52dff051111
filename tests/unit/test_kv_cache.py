"""Prefill + step-by-step decode through the KV cache equals the full-sequence forward, per position kind."""

from __future__ import annotations

import pytest
import torch

from moe_serve import LLM
from moe_serve.engine.kv_cache import KVCache
from tests.conftest import lm_config

CASES = {
    "rotary_rmsnorm_pre": dict(position="rotary", norm="rmsnorm", norm_position="pre"),
    "learned_layernorm_pre": dict(position="learned", norm="layernorm", norm_position="pre"),
    "relative_layernorm_post": dict(
        position="relative", norm="layernorm", norm_position="post", final_norm=False, embedding_scale=32**0.5
    ),
    "relative_rmsnorm_pre_gqa": dict(position="relative", num_kv_heads=1),
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_prefill_plus_decode_equals_full_forward(make_artifact, overrides) -> None:
    llm = LLM(make_artifact(lm_config(**overrides), seed=7))
    runner, model = llm.engine.runner, llm.artifact.model
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (11, 6, 9)]
    ks = [1, 4, 2]
    with torch.inference_mode():
        hidden, _ = runner.forward(sequences, ks)
        full = model.lm_logits(hidden)  # [B, L, V]

        cache = KVCache(llm.config, num_slots=4, max_len=16, device=torch.device("cpu"), dtype=torch.float32)
        slots = [3, 0, 2]  # arbitrary slots: rows of the cache are independent
        # Prefill in two chunks of different sizes, then decode one token at a time.
        cached = [0, 0, 0]
        steps = [[4, 2, 5], [2, 1, 1]] + [[1, 1, 1]] * 10
        for step in steps:
            rows = [b for b in range(3) if cached[b] < len(sequences[b])]
            if not rows:
                break
            chunks = [sequences[b][cached[b] : cached[b] + step[b]] for b in rows]
            hidden, mask = runner.forward(
                chunks,
                [ks[b] for b in rows],
                start_positions=[cached[b] for b in rows],
                slots=[slots[b] for b in rows],
                cache=cache,
            )
            logits = model.lm_logits(hidden)
            for row, b in enumerate(rows):
                n = len(chunks[row])
                torch.testing.assert_close(logits[row, :n], full[b, cached[b] : cached[b] + n], atol=1e-5, rtol=1e-5)
                cached[b] += n
    assert cached == [len(s) for s in sequences]
