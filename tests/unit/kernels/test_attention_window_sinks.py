"""Sliding-window attention and attention sinks (gpt-oss) and local chunks (Llama 4) in ops.attention: the
C++ paged and packed kernels and the torch path, each against a float64 reference written from the
definition:

    window W: a query at position p sees keys j with p - W < j <= p (transformers' sliding_window_overlay);
    chunk C: a query at position p sees keys j with j // C == p // C, j <= p (chunked_overlay);
    sinks s [H]: softmax over [scores..., s_h] with the sink's column dropped (it weights no value).

Cache slots wholly before every query's window or chunk hold NaN: a key read that should not happen shows."""

from __future__ import annotations

import pytest
import torch

from moe_serve.kernels import ops
from moe_serve.kernels.vocabulary import AttentionBatch, gather_sequence
from tests.triton.test_attention_triton import paged_case

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 24
PATHS = [pytest.param("cpp", marks=pytest.mark.cpu_kernels), "torch"]


def reference(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], batch: AttentionBatch, **shape
) -> torch.Tensor:
    """q [T, H, Dh]; keys[s], values[s] [S_k, G, Dh] of sequence s -> [T, H, Dh], one query at a time."""
    window, chunk, sinks, scale = shape.get("window"), shape.get("chunk"), shape.get("sinks"), q.shape[-1] ** -0.5
    out = torch.empty_like(q, dtype=torch.float64)
    group = q.shape[1] // keys[0].shape[1]
    for t in range(q.shape[0]):
        s, p = int(batch.seq_ids[t]), int(batch.positions[t])
        lo = 0 if window is None else max(0, p - window + 1)
        lo = lo if chunk is None else max(lo, p // chunk * chunk)
        for h in range(q.shape[1]):
            k, v = keys[s][lo : p + 1, h // group].double(), values[s][lo : p + 1, h // group].double()
            logits = k @ q[t, h].double() * scale
            if sinks is not None:
                logits = torch.cat([logits, sinks[h : h + 1].double()])
            probs = torch.softmax(logits, 0)[: k.shape[0]]
            out[t, h] = probs @ v
    return out.float()


def poisoned_case(num_keys: list[int], queries: list[int], window: int | None, chunk: int | None, seed: int):
    """paged_case, then every key and value no query of its sequence may see (before the earliest
    query's window or chunk) set to NaN; the clean keys returned for the reference."""
    q, (k_cache, v_cache), batch = paged_case(num_keys, queries, HEADS, KV_HEADS, HEAD_DIM, torch.float32, seed)
    assert batch.block_tables is not None
    keys, values = [], []
    start = 0
    for s, n in enumerate(num_keys):
        k, v = gather_sequence((k_cache, v_cache), batch.block_tables[s], n)
        keys.append(k.clone())
        values.append(v.clone())
        earliest = int(batch.positions[start])
        start += queries[s]
        unseen = max(0, earliest - window + 1) if window is not None else 0
        unseen = max(unseen, earliest // chunk * chunk) if chunk is not None else unseen
        for j in range(unseen):
            block, off = int(batch.block_tables[s, j // k_cache.shape[-1]]), j % k_cache.shape[-1]
            k_cache[block, :, :, off] = float("nan")
            v_cache[block, :, off, :] = float("nan")
    return q, (k_cache, v_cache), batch, keys, values


CASES = [  # (keys of each sequence, queries of each sequence): decode, a chunk mid-sequence, a whole prompt
    ([70, 5, 33], [1, 1, 1]),
    ([70, 40], [20, 40]),
]


SPANS = [(None, None), (1, None), (5, None), (16, None), (17, None), (40, None), (None, 16), (None, 24), (30, 16)]


@pytest.mark.parametrize(("window", "chunk"), SPANS)
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("path", PATHS)
def test_paged_attention_with_window_chunk_and_sinks(window, chunk, with_sinks, case, path, monkeypatch) -> None:
    num_keys, queries = case
    q, cache, batch, keys, values = poisoned_case(num_keys, queries, window, chunk, seed=len(num_keys) + (window or 0))
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(3)) * 2 if with_sinks else None
    if path == "torch":
        monkeypatch.setattr(ops, "_cpu_ext", lambda x: None)
    scale = HEAD_DIM**-0.5
    got = ops.attention(q, q, q, batch, cache, True, scale, window=window, chunk=chunk, sinks=sinks)
    want = reference(q, keys, values, batch, window=window, chunk=chunk, sinks=sinks)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "chunk"), [(None, None), (3, None), (16, None), (21, None), (None, 8), (None, 16)])
@pytest.mark.parametrize("path", PATHS)
def test_packed_attention_with_window_chunk_and_sinks(window, chunk, path, monkeypatch) -> None:
    """Keys packed with the queries (no cache): two whole prompts."""
    gen = torch.Generator().manual_seed(11)
    lens = [37, 20]
    t = sum(lens)
    q = torch.randn(t, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen)
    batch = AttentionBatch(
        seq_ids=torch.repeat_interleave(torch.arange(2), torch.tensor(lens)),
        positions=torch.cat([torch.arange(n) for n in lens]),
        num_keys=torch.tensor(lens),
        seq_starts=torch.tensor([0, lens[0]]),
        seq_lens=tuple(lens),
        num_keys_host=tuple(lens),
    )
    sinks = torch.randn(HEADS, generator=gen)
    if path == "torch":
        monkeypatch.setattr(ops, "_cpu_ext", lambda x: None)
    got = ops.attention(q, k, v, batch, None, True, HEAD_DIM**-0.5, window=window, chunk=chunk, sinks=sinks)
    want = reference(q, list(k.split(lens)), list(v.split(lens)), batch, window=window, chunk=chunk, sinks=sinks)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.cpu_kernels
def test_window_and_sinks_are_checked() -> None:
    q, cache, batch = paged_case([20], [1], HEADS, KV_HEADS, HEAD_DIM, torch.float32, 0)
    with pytest.raises(ValueError, match="sliding window or local chunks need causal attention"):
        ops.attention(q, q, q, batch, cache, False, 1.0, chunk=4)
    with pytest.raises(RuntimeError, match=r"sinks must be \[4\] \(one a query head\)"):
        ops.attention(q, q, q, batch, cache, True, 1.0, sinks=torch.zeros(3))


@pytest.mark.cpu_kernels
def test_a_query_deep_in_a_sequence_gives_the_same_bits_on_one_thread_or_two() -> None:
    """One query over 3,000 cached keys is worth both threads (the kernel counts its keys, not its queries):
    each (token, head) stays one thread's, in the same order, so its bits do not depend on the split; and a
    window's first keys (NaN here) are never read."""
    q, cache, batch, keys, values = poisoned_case([3000, 40], [1, 2], 2500, None, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = ops.attention(q, q, q, batch, cache, True, HEAD_DIM**-0.5, window=2500)
        torch.set_num_threads(2)
        split = ops.attention(q, q, q, batch, cache, True, HEAD_DIM**-0.5, window=2500)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, split)
    torch.testing.assert_close(alone, reference(q, keys, values, batch, window=2500), atol=2e-5, rtol=1e-5)
