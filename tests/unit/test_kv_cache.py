"""Paged KV cache: prefill in chunks, then step-by-step decode, with several sequences interleaved in the
cache's blocks, equals the full-sequence forward, for every position kind."""

from __future__ import annotations

import pytest
import torch

from moe_serve import LLM, EngineConfig
from moe_serve.engine.scheduler import ScheduledSequence, SchedulerOutput
from moe_serve.engine.sequence import Sequence
from tests.batches import KERNELS, use_kernels
from tests.conftest import lm_config

CASES = {
    "rotary_rmsnorm_pre": dict(position="rotary", norm="rmsnorm", norm_position="pre"),
    "learned_layernorm_pre": dict(position="learned", norm="layernorm", norm_position="pre"),
    "relative_layernorm_post": dict(
        position="relative", norm="layernorm", norm_position="post", final_norm=False, embedding_scale=32**0.5
    ),
    "relative_rmsnorm_pre_gqa": dict(position="relative", num_kv_heads=1),
}


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_prefill_plus_decode_equals_full_forward(make_artifact, monkeypatch, overrides, kernels) -> None:
    use_kernels(monkeypatch, kernels)
    llm = LLM(make_artifact(lm_config(**overrides), seed=7), EngineConfig(block_size=16))
    runner, model, blocks = llm.engine.runner, llm.artifact.model, llm.engine.blocks
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (11, 6, 9)]
    ks = [1, 4, 2]
    with torch.inference_mode():
        hidden, _ = runner.forward_padded(sequences, ks)
        full = model.lm_logits(hidden)  # [B, L, V]

    seqs = [
        Sequence(f"s{b}", 0, tokens, len(tokens), k) for b, (tokens, k) in enumerate(zip(sequences, ks, strict=True))
    ]
    # Prefill in two chunks of different sizes, then decode one token at a time; blocks are taken as the
    # sequences grow, so each one's blocks interleave with the others' in the cache.
    steps = [[4, 2, 5], [2, 1, 1]] + [[1, 1, 1]] * 10
    for step in steps:
        items = []
        for seq, n in zip(seqs, step, strict=True):
            n = min(n, seq.num_tokens - seq.num_computed_tokens)
            if n:
                blocks.append(seq, n)
                items.append(ScheduledSequence(seq, seq.num_computed_tokens, n))
        if not items:
            break
        with torch.inference_mode():
            hidden, lens, _ = runner.forward(SchedulerOutput(items))
            logits = model.lm_logits(hidden).split(lens)
        for item, rows in zip(items, logits, strict=True):
            b = seqs.index(item.seq)
            torch.testing.assert_close(rows, full[b, item.start : item.end], atol=1e-5, rtol=1e-5)
            item.seq.num_computed_tokens = item.end
    assert [s.num_computed_tokens for s in seqs] == [len(t) for t in sequences]
    assert len({b for s in seqs for b in s.block_table}) == sum(len(s.block_table) for s in seqs)
