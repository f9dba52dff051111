"""The CUDA kernels (moe_serve.kernels.cuda, reached through moe_serve.kernels.ops) against the torch
references on a GPU: every dtype, every k, mixed k, empty rows, 64 experts, GQA and long contexts, and no
host sync. Skipped without CUDA (CI); `make gpu-check` runs them on a GPU machine.

Tolerances are relative errors ||out - ref|| / ||ref|| against an fp32 reference: fp32 1e-4 (the kernels
use IEEE fp32 dots, not tf32), fp16 5e-3, bf16 2e-2 (one rounding of the operands and of the output)."""

from __future__ import annotations

import math

import pytest
import torch

from moe_serve.kernels import cuda, ops
from moe_serve.kernels.reference import attention_torch, moe_experts_torch, topk_route_torch
from moe_serve.kernels.vocabulary import AttentionBatch, ExpertWeights, Weighting, cache_shapes, gather_sequence

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DEVICE = "cuda"


@pytest.fixture(autouse=True)
def triton_kernels() -> None:
    if cuda.kernels() is None:
        pytest.fail("Triton is missing: the CUDA kernels cannot run (pip install triton)")
    torch.manual_seed(0)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "NaN or inf in the output"
    return ((out.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm().clamp(min=1e-30)).item()


def random_bank(
    experts: int, hidden: int, inner: int, glu: bool, bias: bool, activation: str = "silu"
) -> ExpertWeights:
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=DEVICE) / math.sqrt(shape[-1])

    return ExpertWeights(
        w1=rand(experts, inner, hidden),
        w2=rand(experts, hidden, inner),
        activation=activation,
        b1=rand(experts, inner) if bias else None,
        w3=rand(experts, inner, hidden) if glu else None,
        b3=rand(experts, inner) if bias and glu else None,
        b2=rand(experts, hidden) if bias else None,
    )


def cast_bank(bank: ExpertWeights, dtype: torch.dtype) -> ExpertWeights:
    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dtype).contiguous()

    return ExpertWeights(
        cast(bank.w1), cast(bank.w2), bank.activation, cast(bank.b1), cast(bank.w3), cast(bank.b3), cast(bank.b2)
    )  # type: ignore[arg-type]


def routed(tokens: int, experts: int, token_k: torch.Tensor, max_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, experts, device=DEVICE)
    return ops.topk_route(logits, token_k.to(DEVICE), max_k, Weighting.SOFTMAX_CHOSEN)


def moe_check(dtype: torch.dtype, tokens: int, experts: int, token_k: torch.Tensor, max_k: int, **bank_args) -> None:
    bank = random_bank(experts, 256, 320, **bank_args)
    x = torch.randn(tokens, 256, device=DEVICE)
    ids, weights = routed(tokens, experts, token_k, max_k)
    out = ops.moe_experts(x.to(dtype), ids, weights, cast_bank(bank, dtype))
    reference = moe_experts_torch(x.to(dtype).float().cpu(), ids.cpu(), weights.cpu(), _cpu(cast_bank(bank, dtype)))
    assert out.dtype == dtype and out.shape == x.shape
    assert relative_error(out, reference) < TOLERANCE[dtype]


def _cpu(bank: ExpertWeights) -> ExpertWeights:
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.float().cpu()

    return ExpertWeights(
        move(bank.w1), move(bank.w2), bank.activation, move(bank.b1), move(bank.w3), move(bank.b3), move(bank.b2)
    )  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_moe_matches_torch_at_every_k(dtype: torch.dtype, k: int) -> None:
    moe_check(dtype, 37, 8, torch.full((37,), k), k, glu=True, bias=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moe_mixed_k_and_rows_with_every_slot_unused(dtype: torch.dtype) -> None:
    token_k = torch.randint(0, 5, (53,))
    token_k[::7] = 0  # no experts at all (padding rows of a CUDA graph)
    moe_check(dtype, 53, 8, token_k, 4, glu=False, bias=True, activation="gelu")
    bank = cast_bank(random_bank(8, 256, 320, glu=True, bias=True), dtype)
    ids, weights = routed(53, 8, token_k, 4)
    out = ops.moe_experts(torch.randn(53, 256, device=DEVICE, dtype=dtype), ids, weights, bank)
    assert (out[token_k.to(DEVICE) == 0] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moe_64_experts(dtype: torch.dtype) -> None:
    moe_check(dtype, 200, 64, torch.randint(1, 9, (200,)), 8, glu=True, bias=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moe_row_result_does_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    """Bitwise: the tiling depends on the shapes of the weights only, never on the number of rows."""
    bank = cast_bank(random_bank(8, 256, 320, glu=True, bias=False), dtype)
    x = torch.randn(64, 256, device=DEVICE, dtype=dtype)
    ids, weights = routed(64, 8, torch.randint(1, 5, (64,)), 4)
    together = ops.moe_experts(x, ids, weights, bank)
    for row in (0, 17, 63):
        alone = ops.moe_experts(x[row : row + 1], ids[row : row + 1], weights[row : row + 1], bank)
        assert torch.equal(alone[0], together[row])


@pytest.mark.parametrize(
    ("rows", "experts", "max_k", "weighting"),
    [
        (1, 8, 2, Weighting.SOFTMAX_CHOSEN),
        (64, 8, 8, Weighting.SOFTMAX_ALL),
        (300, 128, 8, Weighting.SOFTMAX_CHOSEN),
        (7, 16, 16, Weighting.UNIFORM),
    ],
)
def test_routing_kernels_match_the_torch_routing(rows: int, experts: int, max_k: int, weighting: Weighting) -> None:
    """The routing kernels (moe_serve.kernels.cuda.routing): ids and the alignment integer for integer, weights
    to fp32 rounding, every k from 0 to max k in one batch, ties included."""
    from moe_serve.kernels import static_moe
    from moe_serve.kernels.cuda import routing

    logits = torch.randn(rows, experts, device=DEVICE)
    logits[0, ::2] = 0.25  # ties: the lowest index first
    token_k = torch.arange(rows, device=DEVICE) % (max_k + 1)
    ids, weights = ops.topk_route(logits, token_k, max_k, weighting)
    want_ids, want_weights = topk_route_torch(logits, token_k, max_k, weighting)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-7)
    for block_m in (16, 64):
        got, want = routing.align(ids, experts, block_m), static_moe.align(ids, experts, block_m)
        assert torch.equal(got.sorted_slots, want.sorted_slots) and torch.equal(got.block_expert, want.block_expert)


def test_routing_and_moe_make_no_host_sync() -> None:
    bank = cast_bank(random_bank(8, 256, 320, glu=True, bias=False), torch.bfloat16)
    x = torch.randn(16, 256, device=DEVICE, dtype=torch.bfloat16)
    logits = torch.randn(16, 8, device=DEVICE)
    token_k = torch.randint(0, 5, (16,), device=DEVICE)
    ops.moe_experts(x, *ops.topk_route(logits, token_k, 4, Weighting.SOFTMAX_CHOSEN), bank)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        k = ops.top_p_k(logits, torch.full((16,), 0.7, device=DEVICE), torch.ones_like(token_k), token_k, 4)
        ids, weights = ops.topk_route(logits, k, 4, Weighting.SOFTMAX_CHOSEN)
        ops.moe_experts(x, ids, weights, bank)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---- attention --------------------------------------------------------------------------------------


def paged_setup(dtype: torch.dtype, lengths: list[int], queries: list[int], heads: int, kv_heads: int, dim: int):
    """A paged cache holding sequences of `lengths` keys in scrambled blocks, and the batch of their last
    `queries` tokens each (1: decode; more: a prefill chunk ending at the sequence's end)."""
    block = 16
    blocks_each = [-(-n // block) for n in lengths]
    order = torch.randperm(sum(blocks_each) + 3).tolist()  # scrambled, with spare blocks never read
    tables, start = [], 0
    for n in blocks_each:
        tables.append(order[start : start + n])
        start += n
    width = max(blocks_each)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
    num_blocks = len(order)
    k_shape, v_shape = cache_shapes(num_blocks, block, kv_heads, dim)
    cache = (torch.randn(k_shape, device=DEVICE).to(dtype), torch.randn(v_shape, device=DEVICE).to(dtype))
    seq_ids, positions = [], []
    for s, (n, q) in enumerate(zip(lengths, queries, strict=True)):
        seq_ids += [s] * q
        positions += range(n - q, n)
    starts = torch.tensor([0] + list(queries[:-1]), device=DEVICE).cumsum(0)
    batch = AttentionBatch(
        seq_ids=torch.tensor(seq_ids, device=DEVICE),
        positions=torch.tensor(positions, device=DEVICE),
        num_keys=torch.tensor(lengths, device=DEVICE),
        seq_starts=starts,
        seq_lens=tuple(queries),
        num_keys_host=tuple(lengths),
        block_tables=block_tables,
        slot_mapping=None,
    )
    q = torch.randn(len(seq_ids), heads, dim, device=DEVICE).to(dtype)
    return q, cache, batch


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_attention_decode_matches_sdpa_gqa_4k(dtype: torch.dtype) -> None:
    lengths = [4096, 1, 17, 1000, 2049]
    q, cache, batch = paged_setup(dtype, lengths, [1] * len(lengths), heads=32, kv_heads=8, dim=128)
    out = ops.attention(q, q, q, batch, cache, causal=True, scale=128**-0.5)
    reference = attention_torch(
        q.float(), q.float(), q.float(), batch, (cache[0].float(), cache[1].float()), True, 128**-0.5
    )
    assert relative_error(out, reference) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_attention_prefill_chunks_match_sdpa(dtype: torch.dtype) -> None:
    """Chunks that start mid-sequence (chunked prefill, a prefix-cache hit) and a whole prompt."""
    lengths, queries = [700, 64, 300], [200, 64, 37]
    q, cache, batch = paged_setup(dtype, lengths, queries, heads=8, kv_heads=2, dim=64)
    out = ops.attention(q, q, q, batch, cache, causal=True, scale=0.125)
    reference = attention_torch(
        q.float(), q.float(), q.float(), batch, (cache[0].float(), cache[1].float()), True, 0.125
    )
    assert relative_error(out, reference) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_packed_attention_without_cache_matches_sdpa(dtype: torch.dtype) -> None:
    """Encoders: each sequence's own rows, bidirectional."""
    lengths = [33, 1, 128]
    total = sum(lengths)
    q = torch.randn(total, 4, 32, device=DEVICE).to(dtype)
    k = torch.randn(total, 4, 32, device=DEVICE).to(dtype)
    v = torch.randn(total, 4, 32, device=DEVICE).to(dtype)
    seq_ids = torch.repeat_interleave(torch.arange(3, device=DEVICE), torch.tensor(lengths, device=DEVICE))
    starts = torch.tensor([0, 33, 34], device=DEVICE)
    positions = torch.arange(total, device=DEVICE) - starts[seq_ids]
    batch = AttentionBatch(
        seq_ids, positions, torch.tensor(lengths, device=DEVICE), starts, tuple(lengths), tuple(lengths)
    )
    out = ops.attention(q, k, v, batch, None, causal=False, scale=32**-0.5)
    reference = attention_torch(q.float(), k.float(), v.float(), batch, None, False, 32**-0.5)
    assert relative_error(out, reference) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_torch(dtype: torch.dtype) -> None:
    x = torch.randn(77, 1000, device=DEVICE).to(dtype)
    weight = torch.randn(1000, device=DEVICE).to(dtype)
    out = ops.rms_norm(x, weight, 1e-6)
    x32 = x.float().cpu()
    reference = weight.float().cpu() * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert out.dtype == dtype and relative_error(out, reference) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_and_cache_write_match_torch(dtype: torch.dtype) -> None:
    from moe_serve.layers.positions import apply_rotary, rotary_cos_sin

    tokens, heads, kv_heads, dim, block = 40, 8, 2, 64, 16
    q = torch.randn(tokens, heads, dim, device=DEVICE).to(dtype)
    k = torch.randn(tokens, kv_heads, dim, device=DEVICE).to(dtype)
    v = torch.randn(tokens, kv_heads, dim, device=DEVICE).to(dtype)
    cos, sin = rotary_cos_sin(torch.randint(0, 4096, (tokens,), device=DEVICE), dim, 10000.0)
    k_shape, v_shape = cache_shapes(8, block, kv_heads, dim)
    cache = (
        torch.full(k_shape, float("nan"), device=DEVICE).to(dtype),
        torch.full(v_shape, float("nan"), device=DEVICE).to(dtype),
    )
    slots = torch.randperm(8 * block, device=DEVICE)[:tokens]
    slots[5] = -1  # a padding row: written nowhere
    batch = AttentionBatch(
        torch.zeros(tokens, dtype=torch.long, device=DEVICE),
        torch.arange(tokens, device=DEVICE),
        torch.tensor([tokens], device=DEVICE),
        torch.zeros(1, dtype=torch.long, device=DEVICE),
        (tokens,),
        (tokens,),
        torch.zeros(1, 8, dtype=torch.int32, device=DEVICE),
        slots,
    )
    q_out, k_out = ops.rotary_write(q.clone(), k.clone(), v, (cos, sin), cache, batch)
    assert relative_error(q_out, apply_rotary(q.float(), cos, sin)) < TOLERANCE[dtype]
    assert relative_error(k_out, apply_rotary(k.float(), cos, sin)) < TOLERANCE[dtype]
    keys, values = gather_sequence(cache, torch.arange(8, device=DEVICE), 8 * block)
    written = slots[slots >= 0]
    assert torch.equal(keys[written], k_out[slots >= 0].to(dtype))
    assert torch.equal(values[written], v[slots >= 0])
    untouched = torch.ones(8 * block, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert keys[untouched].isnan().all() and values[untouched].isnan().all()
