"""Multi-head latent attention's C++ kernel (csrc/latent_attention.cpp) and the torch path it
replaces on the CPU (kernels.latent), each against a float64 reference written from the definition: a query of
sequence s at position p sees the rows of keys 0..p, gathered through s's block table,

    out_h = softmax_j(scale * q_h . row_j) @ row_j[:R]    (row_j: C = R + P values, the latent then the rope key)

Batches mix prefill chunks from position 0, chunks starting mid-sequence (a later chunk of a chunked prefill,
the rest of a prompt after a prefix-cache hit) and decodes, over block sizes the engine accepts (any size from 1:
EngineConfig.block_size), 16 and not. Every slot no query may read (past a sequence's keys, blocks no sequence
owns, the table's padding) holds NaN, so a read that should not happen fails the comparison. A sequence's rows
from the kernel are bitwise the same alone as in any batch."""

from __future__ import annotations

import pytest
import torch

from moe_serve.kernels import cpu_extension, latent, ops
from moe_serve.kernels.latent import LatentCache
from moe_serve.kernels.vocabulary import AttentionBatch
from tests.batches import KERNELS, use_kernels

# (keys the sequence has once this step's tokens are in, this step's queries: the last ones of those keys)
MIXED = [(7, 7), (32, 13), (40, 1), (1, 1), (21, 5), (70, 1), (48, 17)]  # chunks from 0 and mid-way, decodes
DECODES = [(40, 1), (1, 1), (70, 1), (17, 1)]  # a decode-only step: the torch path's batched product
BLOCK_SIZES = [1, 5, 12, 16, 32]
DIMS = [(24, 8), (16, 8)]  # (R, P): a value tail of 8 (R = 24); a key tail of 8 (C = 24, the exporter tests')


def make_case(
    seqs: list[tuple[int, int]], heads: int, rank: int, rope: int, block_size: int, seed: int
) -> tuple[torch.Tensor, LatentCache, AttentionBatch]:
    """q [T, H, C], a cache holding each sequence's keys in blocks shuffled across sequences (NaN everywhere
    else: unused slots, unused blocks, and the block every table is padded with), and the step's batch."""
    generator = torch.Generator().manual_seed(seed)
    width = rank + rope
    blocks_of = [-(-n // block_size) for n, _ in seqs]
    num_blocks = sum(blocks_of) + 3  # three blocks no sequence owns
    cache = torch.full((num_blocks, block_size, width), float("nan"))
    order = torch.randperm(num_blocks, generator=generator).tolist()
    padding = order.pop()  # never a sequence's block: what each table is padded with
    tables = torch.full((len(seqs), max(blocks_of) + 1), padding, dtype=torch.int32)
    for s, ((n, _), count) in enumerate(zip(seqs, blocks_of, strict=True)):
        owned = [order.pop() for _ in range(count)]
        tables[s, :count] = torch.tensor(owned, dtype=torch.int32)
        for j in range(n):
            cache[owned[j // block_size], j % block_size] = torch.randn(width, generator=generator)
    lens = [m for _, m in seqs]
    seq_ids = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(lens))
    positions = torch.cat([torch.arange(n - m, n) for n, m in seqs])
    rows = tables.long()[seq_ids, positions // block_size] * block_size + positions % block_size
    batch = AttentionBatch(
        seq_ids=seq_ids,
        positions=positions,
        num_keys=torch.tensor([n for n, _ in seqs]),
        seq_starts=torch.tensor([0, *lens[:-1]]).cumsum(0),
        seq_lens=tuple(lens),
        num_keys_host=tuple(n for n, _ in seqs),
        block_tables=tables,
        slot_mapping=rows,
    )
    q = torch.randn(len(positions), heads, width, generator=generator)
    return q, LatentCache(cache), batch


def reference(q: torch.Tensor, cache: LatentCache, batch: AttentionBatch, rank: int, scale: float) -> torch.Tensor:
    """float64, a sequence at a time: its rows gathered one key at a time through its block table, the
    scores of keys after each query's position masked, softmax, the rows' first R values weighted."""
    assert batch.block_tables is not None
    block_size = cache.latent.shape[1]
    out = torch.empty(q.shape[0], q.shape[1], rank, dtype=torch.float64)
    start = 0
    for s, (n, num_keys) in enumerate(zip(batch.seq_lens, batch.num_keys_host, strict=True)):
        table = batch.block_tables[s].tolist()
        keys = torch.stack([cache.latent[table[j // block_size], j % block_size] for j in range(num_keys)]).double()
        queries = q[start : start + n].double()  # [n, H, C]
        scores = torch.einsum("nhc,lc->nhl", queries, keys) * scale
        after = torch.arange(num_keys)[None, :] > batch.positions[start : start + n, None]  # [n, L]
        probs = torch.softmax(scores.masked_fill(after[:, None, :], float("-inf")), dim=-1)
        out[start : start + n] = torch.einsum("nhl,lr->nhr", probs, keys[:, :rank])
        start += n
    return out


def kernel(q: torch.Tensor, cache: LatentCache, batch: AttentionBatch, rank: int, scale: float) -> torch.Tensor:
    ext = cpu_extension()
    args = (batch.block_tables, batch.seq_ids, batch.positions, batch.num_keys)
    return ext.latent_attention(q, cache.latent, *args, rank, scale)


def some_sequences(q: torch.Tensor, batch: AttentionBatch, order: list[int]) -> tuple[torch.Tensor, AttentionBatch]:
    """The queries of the sequences `order` names, in that order, as a step of their own (their table rows,
    sequence ids 0..len(order) - 1): the same cache rows, other batch neighbours."""
    assert batch.block_tables is not None and batch.slot_mapping is not None
    rows = torch.cat(
        [torch.arange(int(batch.seq_starts[s]), int(batch.seq_starts[s]) + batch.seq_lens[s]) for s in order]
    )
    lens = [batch.seq_lens[s] for s in order]
    step = AttentionBatch(
        seq_ids=torch.repeat_interleave(torch.arange(len(order)), torch.tensor(lens)),
        positions=batch.positions[rows],
        num_keys=batch.num_keys[order],
        seq_starts=torch.tensor([0, *lens[:-1]]).cumsum(0),
        seq_lens=tuple(lens),
        num_keys_host=tuple(batch.num_keys_host[s] for s in order),
        block_tables=batch.block_tables[order],
        slot_mapping=batch.slot_mapping[rows],
    )
    return q[rows], step


def rows_of(out: torch.Tensor, batch: AttentionBatch, s: int) -> torch.Tensor:
    start = int(batch.seq_starts[s])
    return out[start : start + batch.seq_lens[s]]


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("rank, rope", DIMS)
@pytest.mark.parametrize("heads", [1, 4, 7, 16])  # 7: every pass the heads take (8 with AVX-512, 4, 2, 1)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_the_kernel_equals_the_reference(block_size: int, heads: int, rank: int, rope: int) -> None:
    q, cache, batch = make_case(MIXED, heads, rank, rope, block_size, seed=block_size * 31 + heads)
    scale = (rank + rope) ** -0.5
    got = kernel(q, cache, batch, rank, scale)
    assert got.shape == (q.shape[0], heads, rank) and got.isfinite().all()  # no NaN slot was read
    torch.testing.assert_close(got.double(), reference(q, cache, batch, rank, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads", [4, 16])
@pytest.mark.parametrize("block_size", [12, 16])
def test_a_sequence_alone_equals_itself_in_any_batch(block_size: int, heads: int, threads: int) -> None:
    """Bitwise, alone, in the mixed batch, in it reversed and among the decodes only: the heads per work item
    follow the step's size (16 heads: a decode alone on two threads takes them in blocks of 8 with AVX-512, 4
    with AVX2, a large step all at once) and the thread count how the work is split, never a row's result."""
    rank, rope = 24, 8
    q, cache, batch = make_case(MIXED, heads, rank, rope, block_size, seed=heads)
    decodes = [s for s, (_, m) in enumerate(MIXED) if m == 1]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = kernel(q, cache, batch, rank, 0.3)
        for order in [[s] for s in range(len(MIXED))] + [list(reversed(range(len(MIXED)))), decodes]:
            q_o, step = some_sequences(q, batch, order)
            out = kernel(q_o, cache, step, rank, 0.3)
            for i, s in enumerate(order):
                assert torch.equal(rows_of(out, step, i), rows_of(together, batch, s)), (order, s)
    finally:
        torch.set_num_threads(before)


@pytest.mark.cpu_kernels
def test_large_steps_split_across_threads_give_the_same_rows() -> None:
    """A step with enough work to go to at::parallel_for (most steps above are small enough to run inline):
    close to the reference, and every sequence's rows bitwise its rows alone. R = 72: values 64 at a time in
    registers, then a tail of 8; C = 88, a key tail of 8."""
    seqs = [(300, 1), (257, 64), (129, 1), (64, 64)]
    rank, rope, heads = 72, 16, 16
    q, cache, batch = make_case(seqs, heads, rank, rope, 16, seed=3)
    together = kernel(q, cache, batch, rank, 0.1)
    torch.testing.assert_close(together.double(), reference(q, cache, batch, rank, 0.1), rtol=1e-5, atol=1e-5)
    for s in range(len(seqs)):
        q_s, alone = some_sequences(q, batch, [s])
        assert torch.equal(kernel(q_s, cache, alone, rank, 0.1), rows_of(together, batch, s)), s


@pytest.mark.parametrize("seqs", [MIXED, DECODES], ids=["mixed", "decode-only"])
@pytest.mark.parametrize("block_size", [12, 16])
def test_the_torch_path_equals_the_reference(seqs: list[tuple[int, int]], block_size: int) -> None:
    """The path CUDA, bf16 and MOE_SERVE_KERNELS=torch take: per sequence, or a decode-only step batched."""
    rank, rope, heads = 24, 8, 4
    q, cache, batch = make_case(seqs, heads, rank, rope, block_size, seed=7)
    step = torch.empty(0)  # with a cache, the step's own rows are read from it
    got = latent.latent_attention_torch(q, step, batch, cache, rank, 0.25)
    torch.testing.assert_close(got.double(), reference(q, cache, batch, rank, 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", KERNELS)
def test_latent_attention_takes_the_kernel_where_it_applies(which: str, monkeypatch) -> None:
    """float32 on the CPU with a cache: the C++ kernel, bitwise; with the torch kernels forced: the torch path."""
    use_kernels(monkeypatch, which)
    rank, rope, heads = 24, 8, 4
    q, cache, batch = make_case(MIXED, heads, rank, rope, 12, seed=11)
    step = torch.empty(0)
    got = ops.latent_attention(q, step, batch, cache, rank, 0.25)
    if which == "cpu":
        assert torch.equal(got, kernel(q, cache, batch, rank, 0.25))
    else:
        assert torch.equal(got, latent.latent_attention_torch(q, step, batch, cache, rank, 0.25))


@pytest.mark.cpu_kernels
def test_bf16_and_no_cache_take_the_torch_path(monkeypatch) -> None:
    rank, rope, heads = 24, 8, 4

    def refuse(*args, **kwargs):
        raise AssertionError("the C++ kernel was called")

    monkeypatch.setattr(cpu_extension(), "latent_attention", refuse)
    q, cache, batch = make_case(DECODES, heads, rank, rope, 16, seed=5)
    bf16 = LatentCache(cache.latent.bfloat16())
    assert ops.latent_attention(q.bfloat16(), torch.empty(0), batch, bf16, rank, 0.25).dtype == torch.bfloat16
    # No cache: whole sequences from position 0, their keys the step's own rows.
    q, cache, batch = make_case([(9, 9), (5, 5)], heads, rank, rope, 16, seed=6)
    assert batch.slot_mapping is not None
    rows = cache.latent.reshape(-1, rank + rope)[batch.slot_mapping]
    out = ops.latent_attention(q, rows, batch, None, rank, 0.25)
    torch.testing.assert_close(out.double(), reference(q, cache, batch, rank, 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.cpu_kernels
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "q": a["q"].double()}, "q must be float32"),
        (lambda a: {**a, "cache": a["cache"].bfloat16()}, "the cache must be float32"),
        (lambda a: {**a, "cache": a["cache"].transpose(0, 1)}, "the cache must be contiguous"),
        (lambda a: {**a, "q": a["q"][..., :-1]}, r"q's last dimension \(31\) must be the cache rows' width \(32\)"),
        (lambda a: {**a, "rank": 32}, r"the rank R must be in \[1, C\)"),
        (lambda a: {**a, "tables": a["tables"].long()}, "block_tables must be int32"),
        (lambda a: {**a, "positions": a["positions"].int()}, "positions must be int64"),
        (lambda a: {**a, "num_keys": a["num_keys"][:-1]}, "num_keys must be int64"),
        (lambda a: {**a, "tables": a["tables"][:, :1]}, "past its table's 1"),
        (lambda a: {**a, "tables": a["tables"] + 1000}, "not a block of the cache"),
        (lambda a: {**a, "seq_ids": a["seq_ids"] + 100}, "is not in"),
    ],
)
def test_bad_inputs_are_refused_with_a_message(change, message: str) -> None:
    q, cache, batch = make_case(MIXED, 4, 24, 8, 16, seed=1)
    args = dict(
        q=q,
        cache=cache.latent,
        tables=batch.block_tables,
        seq_ids=batch.seq_ids,
        positions=batch.positions,
        num_keys=batch.num_keys,
        rank=24,
    )
    a = change(args)
    with pytest.raises(RuntimeError, match=message):
        cpu_extension().latent_attention(
            a["q"], a["cache"], a["tables"], a["seq_ids"], a["positions"], a["num_keys"], a["rank"], 0.25
        )


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "inner", "out"), [(1, 24, 16), (4, 16, 40), (7, 48, 24)])
def test_head_linear_is_each_heads_map_and_a_rows_result_never_depends_on_its_batch(dtype, heads, inner, out) -> None:
    """The absorbed per-head maps (ops.head_linear, the C++ kernel): y[t, h] = w[h] x[t, h] against float64, and
    each token's rows bitwise the same alone, in a batch of 7 and in one of 64 (a batched matmul's blocking
    follows the token count, which moved a request's log-probabilities with its batch)."""
    generator = torch.Generator().manual_seed(heads)
    weight = torch.randn(heads, out, inner, generator=generator).to(dtype)
    x = torch.randn(64, heads, inner, generator=generator)
    want = torch.einsum("thk,hnk->thn", x.double(), weight.double())
    got = ops.head_linear(x, weight)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    for t in (0, 5, 63):
        assert torch.equal(ops.head_linear(x[t : t + 1], weight)[0], got[t])
        assert torch.equal(ops.head_linear(x[max(0, t - 6) : t + 1], weight)[-1], got[t])
