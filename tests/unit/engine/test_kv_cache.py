"""Paged KV cache: prefill in chunks, then step-by-step decode, with several sequences interleaved in the
cache's blocks, equals the full-sequence forward, for every position kind; and how the layers of a model whose
layers read back differently are cut into KV groups."""

from __future__ import annotations

import pytest
import torch

from moe_serve import LLM, EngineConfig
from moe_serve.engine.kv_cache import KVCache, cache_shape, kv_layout
from moe_serve.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from moe_serve.engine.sequence import Sequence
from moe_serve.model_config import LayerAttention
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


def _spans(*reaches: int | None) -> tuple[LayerAttention, ...]:
    return tuple(LayerAttention(window=r) for r in reaches)


@pytest.mark.parametrize(
    ("spans", "groups"),
    [
        ((None, None), [(None, (0, 1))]),  # plain attention: one group, nothing released
        (_spans(8, 16), [(16, (0, 1))]),  # every layer local: one group at the widest reach
        (_spans(8, None, 8, None), [(None, (1, 3)), (8, (0, 2))]),  # gpt-oss: sliding and full, alternating
        (_spans(8, 8, 8, None, 8, 8, 8, None), [(None, (3, 7)), (8, (0, 1)), (8, (2, 4)), (8, (5, 6))]),  # Llama 4
        (_spans(8, None, 8), [(None, (1,)), (8, (0,)), (8, (2,))]),  # no common size above 1: groups of one layer
    ],
)
def test_kv_groups_are_full_and_local_layers_cut_to_one_size(spans, groups) -> None:
    if spans == (None, None):
        config = lm_config()
    else:
        config = lm_config(num_layers=len(spans), layer_attention=spans, moe=None)
    layout = kv_layout(config)
    assert [(g.reach, g.layers) for g in layout.groups] == groups
    assert [layout.groups[g].layers[layout.slot_of(i)] for i, g in enumerate(layout.layer_groups)] == list(
        range(len(spans))
    )


def test_a_hybrid_model_holds_a_block_id_per_group_size_of_layers() -> None:
    """gpt-oss's layout (sliding and full layers alternating): a block holds two of the four layers, so the same
    budget holds twice the block ids, and the four layers' caches are two shared tensors."""
    plain, hybrid = (
        lm_config(num_layers=4, moe=None),
        lm_config(num_layers=4, moe=None, layer_attention=_spans(8, None, 8, None)),
    )
    budget = 1 << 20
    shapes = [cache_shape(c, torch.float32, budget, 16) for c in (plain, hybrid)]
    assert shapes[1].num_blocks == 2 * shapes[0].num_blocks and shapes[1].sequence_tokens == shapes[0].num_tokens
    cache = KVCache(hybrid, shapes[1], torch.device("cpu"), torch.float32)
    assert (
        cache.layers[0] is cache.layers[1]
        and cache.layers[2] is cache.layers[3]
        and cache.layers[0] is not cache.layers[2]
    )
