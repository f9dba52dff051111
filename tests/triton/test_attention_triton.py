"""The Triton attention kernel under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) against
reference.attention_torch: paged through scrambled block tables (decode, a prefill chunk starting mid-sequence,
non-causal), packed without a cache, GQA and plain heads, a head dim that is not a power of two.

Every cache slot that no query may see holds NaN, and block tables are padded with a block of NaN: a key
read that should not happen shows in the output. Shapes are tiny: each program costs 10-40 ms here."""

from __future__ import annotations

import pytest
import torch

from moe_serve.kernels import reference
from moe_serve.kernels.vocabulary import AttentionBatch, cache_shapes

pytestmark = pytest.mark.triton_interp

BLOCK_SIZE = 16
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


def paged_case(
    num_keys: list[int],
    queries: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    block_size: int = BLOCK_SIZE,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], AttentionBatch]:
    """Sequence s has num_keys[s] keys in the cache, its last queries[s] the step's queries; blocks are
    handed out in a random order, the tables padded with the index of a block of NaN."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in num_keys]
    total = sum(blocks) + 2  # one spare, one poison
    order = torch.randperm(total - 1, generator=gen).tolist()
    poison = total - 1
    k_shape, v_shape = cache_shapes(total, block_size, kv_heads, head_dim)
    k_cache = torch.full(k_shape, float("nan"), dtype=dtype)
    v_cache = torch.full(v_shape, float("nan"), dtype=dtype)
    width = max(blocks) + 1
    tables = torch.full((len(num_keys), width), poison, dtype=torch.int32)
    for s, n in enumerate(num_keys):
        tables[s, : blocks[s]] = torch.tensor(order[: blocks[s]], dtype=torch.int32)
        order = order[blocks[s] :]
        slots = tables[s].long()[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
        keys = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        values = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        k_cache[slots // block_size, :, :, slots % block_size] = keys
        v_cache[slots // block_size, :, slots % block_size, :] = values
    positions = torch.cat([torch.arange(n - m, n) for n, m in zip(num_keys, queries, strict=True)])
    seq_ids = torch.repeat_interleave(torch.arange(len(queries)), torch.tensor(queries))
    starts = torch.cumsum(torch.tensor([0, *queries[:-1]]), 0)
    batch = AttentionBatch(
        seq_ids=seq_ids,
        positions=positions,
        num_keys=torch.tensor(num_keys),
        seq_starts=starts,
        seq_lens=tuple(queries),
        num_keys_host=tuple(num_keys),
        block_tables=tables,
    )
    q = torch.randn(sum(queries), heads, head_dim, generator=gen).to(dtype)
    return q, (k_cache, v_cache), batch


def run_paged(q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch, causal: bool):
    from moe_serve.kernels.cuda.attention import paged_attention

    assert batch.block_tables is not None
    scale = q.shape[-1] ** -0.5
    got = paged_attention(q, *cache, batch.block_tables, batch.seq_ids, batch.positions, batch.num_keys, causal, scale)
    want = reference.attention_torch(q, q, q, batch, cache, causal, scale)  # k, v unused with a cache
    return got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)])
def test_decode_scrambled_blocks(dtype: torch.dtype, heads: int, kv_heads: int) -> None:
    # Lengths: one block exactly, mid-block, and past one 64-key iteration.
    q, cache, batch = paged_case([16, 5, 70], [1, 1, 1], heads, kv_heads, 32, dtype, seed=1)
    got, want = run_paged(q, cache, batch, causal=True)
    torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_chunk_mid_sequence(dtype: torch.dtype) -> None:
    # A 40-token chunk of a sequence with 30 keys already cached (chunked prefill, a prefix-cache hit),
    # beside a decode token and a second, short chunk: tiles of 32 tokens straddle neither sequence.
    q, cache, batch = paged_case([70, 9, 12], [40, 1, 12], 4, 2, 32, dtype, seed=2)
    got, want = run_paged(q, cache, batch, causal=True)
    torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("block_size", [32, 128])
def test_larger_blocks(block_size: int) -> None:
    # 128-key blocks: one block per loop iteration (keys per iteration = the block size).
    q, cache, batch = paged_case([150, 40], [1, 1], 4, 2, 32, torch.float32, seed=7, block_size=block_size)
    got, want = run_paged(q, cache, batch, causal=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_prefill_tile_boundaries() -> None:
    # 32 tokens per tile (64 rows, groups of 2): a sequence of exactly one tile (its second tile idles),
    # one a token past a tile, and a short one.
    q, cache, batch = paged_case([40, 33, 2], [32, 33, 2], 4, 2, 16, torch.float32, seed=8)
    got, want = run_paged(q, cache, batch, causal=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_non_causal_paged_and_odd_head_dim() -> None:
    # Dh 24: the dot's 32 columns padded with masks; non-causal: every query sees all its sequence's keys.
    q, cache, batch = paged_case([20, 33], [3, 20], 3, 3, 24, torch.float32, seed=3)
    got, want = run_paged(q, cache, batch, causal=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_seq_starts_given_matches_found() -> None:
    from moe_serve.kernels.cuda.attention import paged_attention

    q, cache, batch = paged_case([18, 7], [6, 7], 2, 1, 16, torch.float32, seed=4)
    assert batch.block_tables is not None
    args = (q, *cache, batch.block_tables, batch.seq_ids, batch.positions, batch.num_keys, True, 0.25)
    torch.testing.assert_close(paged_attention(*args, seq_starts=batch.seq_starts), paged_attention(*args))


@pytest.mark.parametrize(
    "causal,dtype,lens",
    [
        (True, torch.float32, [7, 1, 20]),
        (False, torch.float32, [7, 1, 20]),
        (True, torch.float16, [7, 1, 20]),
        (False, torch.float16, [1, 1]),  # one token each: the decode programs
    ],
)
def test_packed_no_cache(causal: bool, dtype: torch.dtype, lens: list[int]) -> None:
    from moe_serve.kernels.cuda.attention import packed_attention

    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim = 4, 2, 24
    q, k, v = (torch.randn(sum(lens), n, head_dim, generator=gen).to(dtype) for n in (heads, kv_heads, kv_heads))
    seq_ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    starts = torch.cumsum(torch.tensor([0, *lens[:-1]]), 0)
    positions = torch.cat([torch.arange(n) for n in lens])
    batch = AttentionBatch(seq_ids, positions, torch.tensor(lens), starts, tuple(lens), tuple(lens))
    got = packed_attention(q, k, v, starts, seq_ids, positions, torch.tensor(lens), causal, 0.3)
    want = reference.attention_torch(q, k, v, batch, None, causal, 0.3)
    torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_strided_query() -> None:
    # q as a view of a fused projection (the launcher makes it contiguous).
    q, cache, batch = paged_case([10, 3], [1, 1], 2, 2, 16, torch.float32, seed=6)
    fused = torch.randn(q.shape[0], 3, 2, 16)
    fused[:, 1] = q
    got, want = run_paged(fused[:, 1], cache, batch, causal=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
