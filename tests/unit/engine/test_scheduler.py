"""The scheduler and block manager without a model: budgets, chunked prefill, admission by free blocks,
preemption by recompute, prefix caching, abort, and prefill chunks sized to bound the join stall."""

from __future__ import annotations

import pytest

from moe_serve.engine.block_manager import BlockManager
from moe_serve.engine.scheduler import (
    LONG_SHARE_BESIDE_INTERACTIVE,
    QUIET_SECONDS_BEFORE_LONG_CHUNKS,
    ScheduledSequence,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from moe_serve.engine.sequence import Sequence, SequenceKind, SequenceStatus, WorkGroup
from moe_serve.engine.step_costs import ROOM_MARGIN, StepCosts

BS = 4  # block size


def seq(prompt_len: int, k: int = 2, name: str = "r", first: int = 0, kind=SequenceKind.GENERATE) -> Sequence:
    tokens = list(range(first, first + prompt_len))
    return Sequence(name, 0, tokens, prompt_len, k, kind)


def estimated_seconds(scheduler: Scheduler, out: SchedulerOutput) -> float:
    """A step's seconds by the scheduler's cost model: what a pretended step took."""
    costs = scheduler.costs
    if not costs.per_token:
        return 0.0
    chunks = sum(costs.chunk_seconds(i.num_tokens, i.start) for i in out.scheduled if not i.is_decode)
    return ((costs.decode_step or 0.0) if out.num_decodes else costs.step_overhead) + chunks


def run_step(scheduler: Scheduler, sample: int = 7) -> list[tuple[str, int]]:
    """Schedule, pretend to compute (taking the cost model's seconds), append a sampled token where the
    prompt is complete."""
    out = scheduler.schedule()
    scheduler.update(out)
    scheduler.step_took(estimated_seconds(scheduler, out))
    for item in out.scheduled:
        if item.completes_prompt and item.seq.kind is SequenceKind.GENERATE:
            item.seq.token_ids.append(sample)
    return [(item.seq.request_id, item.num_tokens) for item in out.scheduled]


def make(num_blocks: int = 16, budget: int = 64, max_seqs: int = 8, caching: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_seqs, budget), BlockManager(num_blocks, BS, caching))


def test_decodes_first_then_chunked_prefill_under_the_token_budget() -> None:
    s = make(budget=8)
    a, b = seq(3, name="a"), seq(20, name="b", first=100)
    s.add(a)
    assert run_step(s) == [("a", 3)]
    s.add(b)
    assert run_step(s) == [("a", 1), ("b", 7)]  # a's decode first, b gets the rest of the budget
    assert run_step(s) == [("a", 1), ("b", 7)]
    assert run_step(s) == [("a", 1), ("b", 6)]  # b's prompt completes: it gets its first token
    assert b.num_output_tokens == 1 and run_step(s) == [("a", 1), ("b", 1)]


def test_admission_waits_for_free_blocks_first_come_first_served() -> None:
    s = make(num_blocks=4, budget=100)
    s.add(a := seq(8, name="a"))  # 2 blocks
    s.add(b := seq(8, name="b", first=50))  # 2 blocks
    s.add(seq(4, name="c", first=90))  # 1 block: would fit after a and b only if nothing else grows
    assert run_step(s) == [("a", 8), ("b", 8)]
    assert [x.request_id for x in s.waiting] == ["c"]
    s.finish(a, "stop")
    assert s.blocks.num_free_blocks == 2
    assert ("c", 4) in run_step(s) and b.status is SequenceStatus.RUNNING


def test_preemption_frees_the_latest_and_recomputes_it_from_the_prefix_cache() -> None:
    s = make(num_blocks=4, budget=100)
    s.add(a := seq(7, name="a"))
    s.add(b := seq(8, name="b", first=50))
    run_step(s)  # a: 2 blocks (7 prompt + 1 sampled = 8 tokens), b: 2 blocks + its token needs a third
    assert s.blocks.num_free_blocks == 0
    out = s.schedule()  # a decodes (fits its 2nd block); b needs a 3rd block: b is preempted
    assert [x.seq.request_id for x in out.scheduled] == ["a"] and out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and not b.block_table
    s.update(out)
    a.token_ids.append(7)
    s.finish(a, "stop")
    assert run_step(s) == [("b", 1)]  # b comes back: its two full blocks (8 tokens) are a prefix-cache hit
    assert b.num_cached_tokens == 8 and b.num_preemptions == 1


def test_a_windowed_model_gives_back_blocks_behind_every_window_and_keeps_shared_ones() -> None:
    """A reach of 5 (every layer reads at most its last 5 keys), blocks of 4: after each step the blocks
    wholly before the next query's reach are released (table entry RELEASED); a block two sequences share
    stays until both release it; a released block keeps its hash, so the prefix cache still finds it."""
    from moe_serve.engine.block_manager import RELEASED

    s = Scheduler(SchedulerConfig(8, 64), BlockManager(16, BS, True, reaches=(5,)))
    s.add(a := seq(10, name="a"))
    run_step(s)  # 10 computed: the next query (position 10) reads from 6, so block 0 (positions 0-3) goes
    second = a.block_table[1]
    assert a.block_table[0] == RELEASED and s.blocks.num_used_blocks == 2
    s.add(b := seq(10, name="b"))  # the same prompt: blocks 0 and 1 from the cache (0 revived from the free list)
    run_step(s)  # a decodes (11 computed), b computes tokens 8 and 9 (10), then releases its block 0
    assert b.num_cached_tokens == 8 and b.block_table[0] == RELEASED and b.block_table[1] == second
    assert s.blocks.blocks[second].ref_count == 2  # a still reads it (positions 6, 7), and so does b
    run_step(s)  # a: 12 computed, reads from 8: releases block 1; b: 11 computed, still reads it
    assert a.block_table[1] == RELEASED and s.blocks.blocks[second].ref_count == 1
    run_step(s)
    assert b.block_table[1] == RELEASED and s.blocks.blocks[second].ref_count == 0
    assert s.blocks.cached_prefix(seq(10, name="c")).num_blocks == 2  # both released blocks, still findable
    s.finish(a, "stop")
    s.finish(b, "stop")
    assert s.blocks.num_used_blocks == 0


def test_prefix_cache_hits_full_blocks_at_the_same_k_only() -> None:
    s = make(num_blocks=32, budget=100)
    s.add(first := seq(10, k=2, name="a"))
    run_step(s)
    s.finish(first, "stop")  # freed, but its two full blocks stay findable
    s.add(same := seq(10, k=2, name="b"))
    s.add(other_k := seq(10, k=3, name="c"))
    assert run_step(s) == [("b", 2), ("c", 10)]
    assert same.num_cached_tokens == 8 and other_k.num_cached_tokens == 0
    assert s.blocks.stats.hit_tokens == 8 and s.blocks.stats.queried_tokens == 30


def test_whole_prompt_in_the_cache_still_computes_its_last_token() -> None:
    s = make(num_blocks=32)
    s.add(a := seq(8, name="a"))
    run_step(s)
    s.finish(a, "stop")
    s.add(b := seq(8, name="b"))
    assert run_step(s) == [("b", 4)] and b.num_cached_tokens == 4  # block 2 holds the last prompt token


def test_scoring_never_takes_the_prefix_cache_shortcut() -> None:
    s = make(num_blocks=32)
    s.add(a := seq(9, name="a"))
    run_step(s)
    s.finish(a, "stop")
    s.add(scored := seq(9, name="s", kind=SequenceKind.SCORE))
    assert run_step(s) == [("s", 9)] and scored.num_cached_tokens == 0


def test_a_full_group_keeps_every_block_while_a_local_group_gives_back_what_is_behind_its_reach() -> None:
    """Two KV groups (gpt-oss: full layers, and sliding layers reading at most 5 keys), blocks of 4: each group
    has its own table of distinct blocks; only the local one releases. A prefix-cache hit needs the full
    group's blocks from the first and the local group's within the next query's reach only: with the local
    block in reach gone, the hit falls back to a shorter prefix whose local blocks are all there."""
    from moe_serve.engine.block_manager import RELEASED

    s = Scheduler(SchedulerConfig(8, 64), BlockManager(32, BS, True, reaches=(None, 5)))
    s.add(a := seq(10, name="a"))
    run_step(s)  # 10 computed: the local group's next query (position 10) reads from 6, so its block 0 goes
    full, local = a.block_tables
    assert len(full) == len(local) == 3 and RELEASED not in full and local[0] == RELEASED
    assert not set(full) & set(local[1:]) and s.blocks.num_used_blocks == 5
    hit = s.blocks.cached_prefix(seq(10, name="b"))  # positions 0-7: the next query (8) reads from 4
    assert hit.num_blocks == 2 and hit.tables == (tuple(full[:2]), (RELEASED, local[1]))
    s.blocks.blocks[local[1]].token_ids = (9, 9, 9, 9)  # the local block in reach is gone (as if reused)
    hit = s.blocks.cached_prefix(seq(10, name="b"))  # positions 0-3: the next query reads from 0, released but cached
    assert hit.num_blocks == 1 and hit.tables[0] == (full[0],) and hit.tables[1] not in ((), (RELEASED,))
    s.add(b := seq(10, name="b"))
    run_step(s)  # a decodes, b is admitted with the one-block hit (its released local block revived)
    assert b.num_cached_tokens == 4 and s.blocks.blocks[full[0]].ref_count == 2
    s.blocks.blocks[full[0]].token_ids = (9, 9, 9, 9)  # the full group's first block gone: no hit at all
    assert s.blocks.cached_prefix(seq(10, name="c")).num_blocks == 0
    s.finish(a, "stop")
    s.finish(b, "stop")
    assert s.blocks.num_used_blocks == 0


def test_a_finished_sequence_frees_its_tail_first_across_the_groups() -> None:
    """A full group and a local one (its reach keeps every block here): freed position by position from the tail,
    the local group's block before the full one's at each position, so the blocks LRU reuses first are the ones
    a later hit needs last. After 4 of the 8 blocks are reused, the first two positions still hit."""
    bm = BlockManager(8, BS, True, reaches=(None, 100))
    a = seq(17, name="a")  # 4 full blocks and a token
    bm.allocate(a, 16, bm.no_prefix())
    a.num_computed_tokens = 16
    bm.commit(a)
    full, local = (list(t) for t in a.block_tables)
    bm.free(a)
    assert list(bm._free) == [b for i in (3, 2, 1, 0) for b in (local[i], full[i])]
    bm.allocate(seq(8, name="x", first=100), 8, bm.no_prefix())  # takes the 4 least recently freed
    assert bm.cached_prefix(seq(17)).num_blocks == 2


def test_lru_eviction_and_a_hash_collision_guard() -> None:
    manager = BlockManager(num_blocks=2, block_size=BS)
    a = seq(5, name="a")
    manager.allocate(a, 5, manager.no_prefix())
    a.num_computed_tokens = 5
    manager.commit(a)
    manager.free(a)
    assert manager.cached_prefix(seq(5, name="again")).ids == [a_block := manager.cached_prefix(seq(5)).ids[0]]
    b = seq(8, name="b", first=40)
    manager.allocate(b, 8, manager.no_prefix())  # takes both free blocks: a's cached block is evicted
    assert a_block in b.block_table and manager.cached_prefix(seq(5)).num_blocks == 0
    manager.blocks[a_block].token_ids = (9, 9, 9, 9)  # same hash, other tokens: not a hit
    assert manager.cached_prefix(seq(5)).num_blocks == 0


def test_abort_frees_blocks_at_once_wherever_the_sequence_is() -> None:
    s = make(num_blocks=8)
    s.add(a := seq(6, name="a"))
    s.add(w := seq(6, name="w", first=30))
    run_step(s)
    s.add(late := seq(6, name="late", first=60))
    s.finish(a, "abort")
    s.finish(late, "abort")
    assert a.is_finished and late.is_finished and not a.block_table
    assert [x.request_id for x in s.running] == ["w"] and not s.waiting
    assert s.blocks.num_used_blocks == len(w.block_table)


def test_classification_inputs_run_whole_without_blocks() -> None:
    s = make(budget=10)
    s.add(seq(12, name="big", kind=SequenceKind.CLASSIFY))
    assert run_step(s) == []  # never chunked: waits for a budget it fits
    s = make(budget=12)
    s.add(c := seq(12, name="c", kind=SequenceKind.CLASSIFY))
    assert run_step(s) == [("c", 12)] and not c.block_table


def test_prefill_chunks_bound_the_step_while_decodes_run() -> None:
    s = make(num_blocks=64, budget=200)
    for i in range(4):
        s.add(seq(3, name=f"d{i}", first=10 * i))
    run_step(s)
    s.costs.decode_step, s.costs.per_token = 0.010, 0.0005  # a decode step 10 ms, a prompt token 0.5 ms
    s.add(seq(200, name="long", first=500))
    steps = [run_step(s) for _ in range(4)]
    chunk = int((3.0 - 1.0) * 0.010 * ROOM_MARGIN / 0.0005)  # 27 tokens keep the step under 3 decode steps
    assert [dict(step)["long"] for step in steps] == [chunk] * 4
    assert all(dict(step)[f"d{i}"] == 1 for step in steps for i in range(4))


def test_chunks_shrink_as_the_prompt_context_grows() -> None:
    """A token late in a long prompt attends to more keys: its chunk gets fewer tokens for the same stall."""
    s = make(num_blocks=64, budget=400)
    for i in range(4):
        s.add(seq(3, name=f"d{i}", first=10 * i))
    run_step(s)
    s.costs.decode_step, s.costs.per_token, s.costs.pair_ratio = 0.010, 0.0002, 0.02
    s.add(seq(400, name="long", first=500))
    chunks, start = [], 0
    for _ in range(3):
        n = dict(run_step(s))["long"]
        assert s.costs.chunk_seconds(n, start) <= (3.0 - 1.0) * 0.010 * ROOM_MARGIN + 1e-12  # within the stall
        assert s.costs.chunk_seconds(n + 1, start) > (3.0 - 1.0) * 0.010 * ROOM_MARGIN  # and as large as fits
        chunks.append(n)
        start += n
    assert chunks[0] > chunks[1] > chunks[2]


def test_calibration_recovers_the_cost_shape() -> None:
    per_token, per_pair = 0.001, 0.00002  # seconds per token, per (query, key) pair
    costs = StepCosts()
    costs.calibrate(lambda n: n * (per_token + per_pair * n / 2), 64, 512)
    assert costs.per_token == pytest.approx(per_token) and costs.pair_ratio == pytest.approx(per_pair / per_token)
    assert costs.step_overhead == pytest.approx(0.0, abs=1e-12)
    assert costs.tokens_within(costs.chunk_seconds(100, 300) * (1 + 1e-9), 300) == 100


def test_calibration_and_the_online_fit_tell_a_steps_overhead_from_its_tokens() -> None:
    """A step's fixed cost (host work, the LM head) is its own term: a few tiny prefills (a 4-token completion's)
    do not teach a per-token rate that makes every later chunk a sliver."""
    overhead, per_token = 0.004, 0.00003
    costs = StepCosts()
    costs.calibrate(lambda n: overhead + n * per_token, 64, 512)
    assert costs.step_overhead == pytest.approx(overhead) and costs.per_token == pytest.approx(per_token)
    for n in (3, 5, 4, 6, 200, 3, 128, 4):  # probes' prompts among heavier chunks, all from position 0
        costs.observe(_prefill_step([(n, 0)]), overhead + n * per_token)
    assert costs.per_token == pytest.approx(per_token, rel=0.05)
    assert costs.tokens_within(0.05 - costs.step_overhead, 0) == pytest.approx((0.05 - overhead) / per_token, rel=0.05)


def _prefill_step(chunks: list[tuple[int, int]]) -> SchedulerOutput:
    """A step that prefills (tokens, start) chunks of fresh prompts (no decodes)."""
    out = SchedulerOutput()
    for i, (n, start) in enumerate(chunks):
        out.scheduled.append(ScheduledSequence(seq(start + n + 1, name=f"p{i}"), start, n))
    return out


def test_online_fit_learns_the_attention_rate_the_calibration_missed() -> None:
    """Calibrated as if attention cost nothing, the costs learn its rate from chunks at growing contexts."""
    per_token, per_pair = 0.0002, 0.0000004  # true: a token at context 500 costs twice one at context 0
    costs = StepCosts()
    costs.calibrate(lambda n: n * per_token, 64, 512)
    assert costs.pair_ratio == 0.0
    for start in range(0, 512, 48):
        seconds = 48 * (per_token + per_pair * (start + 24))
        costs.observe(_prefill_step([(48, start)]), seconds)
    truth = 48 * (per_token + per_pair * (600 + 24))
    assert costs.chunk_seconds(48, 600) == pytest.approx(truth, rel=0.02)


def test_online_fit_keeps_its_shape_when_every_chunk_has_the_same_context() -> None:
    """Steps that cannot tell the two rates apart fit their level; the split between the rates stays bounded
    (the anchor to the current rates keeps the fit solvable)."""
    costs = StepCosts()
    costs.calibrate(lambda n: n * (0.001 + 0.00002 * n / 2), 64, 512)
    ratio = costs.pair_ratio
    for _ in range(20):  # every step: 32 tokens from position 0, twice as slow as calibrated
        costs.observe(_prefill_step([(32, 0)]), 2 * 32 * (0.001 + 0.00002 * 16))
    assert ratio / 2 < costs.pair_ratio < ratio * 2
    # The step's cost is learnt (split between its overhead and its tokens, which such steps cannot tell apart).
    step = costs.step_overhead + costs.chunk_seconds(32, 0)
    assert step == pytest.approx(2 * 32 * (0.001 + 0.00002 * 16), rel=0.02)


def test_online_fit_learns_that_a_deep_chunk_reads_its_cached_context_once() -> None:
    """Deep in a long prompt a chunk's first token costs far more than the next ones (its thousands of cached
    keys come in from memory once): the fit learns that term, so one token there is dear and a chunk of many
    is not, and the step's overhead is not taken for it (a few tokens that deep are no short prompt)."""
    overhead, per_token, per_pair, per_context = 0.001, 0.00003, 0.0000001, 0.0000013
    costs = StepCosts()
    costs.calibrate(lambda n: overhead + n * (per_token + per_pair * n / 2), 64, 512)
    calibrated = costs.step_overhead

    def truth(n: int, start: int) -> float:
        return n * (per_token + per_pair * (start + n / 2)) + per_context * start

    for start in range(2000, 3200, 40):  # capped chunks at growing depth, of 1 to 14 tokens
        for n in (1, 2, 14, 6):
            costs.observe(_prefill_step([(n, start)]), overhead + truth(n, start))
    assert costs.step_overhead == calibrated
    for n in (1, 14, 140):
        assert costs.chunk_seconds(n, 3300) == pytest.approx(truth(n, 3300), rel=0.05)
    assert costs.tokens_within(truth(20, 3300), 3300) in (19, 20)
    assert costs.tokens_within(0.5 * per_context * 3300, 3300) == 0  # not even the context's read fits


def test_the_start_cost_stays_the_calibrated_one_when_the_fit_moves_deep_in_a_prompt() -> None:
    costs = StepCosts()
    costs.calibrate(lambda n: n * (0.00003 + 0.0000001 * n / 2), 64, 512)
    start = costs.start_chunk_seconds(128)
    for _ in range(30):  # every chunk at the same depth: the fit may put their cost anywhere on its line
        costs.observe(_prefill_step([(2, 3000)]), 0.006)
    assert costs.start_chunk_seconds(128) == start
    assert start == pytest.approx(128 * (0.00003 + 0.0000001 * 64))


# ---- long prompts share the engine (one 16-input /v1/score once held a 4-token completion for 49.6 s) ----


def make_fair(
    budget: int = 256, threshold: int = 32, max_long: int = 1, num_blocks: int = 512, alone_seconds: float = 0.0
) -> Scheduler:
    config = SchedulerConfig(
        8,
        budget,
        long_prefill_threshold=threshold,
        long_prefill_chunk=threshold,
        max_long_prefills=max_long,
        long_prefill_alone_seconds=alone_seconds,
    )
    return Scheduler(config, BlockManager(num_blocks, BS, True))


def test_a_short_request_is_admitted_while_long_scoring_inputs_prefill() -> None:
    s = make_fair()
    for i in range(4):  # one /v1/score of 4 long inputs
        s.add(seq(200, name=f"score{i}", first=1000 * i, kind=SequenceKind.SCORE))
    assert run_step(s) == [("score0", 32)]  # one long prompt at a time, its chunk capped
    s.add(short := seq(5, name="short", first=9000))
    assert run_step(s) == [("short", 5), ("score0", 32)]  # admitted at once, ahead of score1..3
    assert short.num_output_tokens == 1 and [x.request_id for x in s.waiting] == ["score1", "score2", "score3"]
    assert run_step(s) == [("short", 1), ("score0", 32)]  # decodes on beside the long prefill


def test_a_long_chunk_is_capped_even_when_nothing_decodes() -> None:
    s = make_fair(budget=1000, threshold=64)
    s.add(seq(300, name="long"))
    steps = [run_step(s) for _ in range(5)]
    # 300 = 64 * 3 + 108: long while more than 64 are left, then the rest (at most 64 more) in one chunk.
    assert steps == [[("long", 64)], [("long", 64)], [("long", 64)], [("long", 64)], [("long", 44)]]


def test_the_next_long_prompt_starts_when_the_first_is_prefilled() -> None:
    s = make_fair(budget=1000, threshold=64)
    s.add(a := seq(150, name="a", kind=SequenceKind.SCORE))
    s.add(seq(150, name="b", first=500, kind=SequenceKind.SCORE))
    assert run_step(s) == [("a", 64)]  # b waits for the long slot
    assert run_step(s) == [("a", 64)]
    assert run_step(s) == [("a", 22)]  # the last chunk: a reads 128 cached keys per token, still long
    s.finish(a, "stop")  # scored (the engine finishes it)
    assert run_step(s) == [("b", 64)]


def test_two_long_slots_and_waiting_long_prompts_keep_their_order() -> None:
    s = make_fair(budget=1000, threshold=16, max_long=2)
    for name in "abc":
        s.add(seq(100, name=name, first=ord(name) * 100, kind=SequenceKind.SCORE))
    s.add(seq(8, name="short", first=5))
    assert run_step(s) == [("short", 8), ("a", 16), ("b", 16)]  # short work first, then long work
    assert [x.request_id for x in s.waiting] == ["c"]


def long_beside_decodes(s: Scheduler, steps: int, slower: float = 1.0) -> tuple[list[dict[str, int]], float, float]:
    """`steps` steps of 4 decodes that never pause beside 16 long inputs of 4,000 tokens; a step's long chunks
    take `slower` times their estimate. -> each step's chunks, long work's seconds, all the steps' seconds."""
    for i in range(4):
        s.add(seq(3, name=f"d{i}", first=10 * i))
    run_step(s)
    s.costs.decode_step, s.costs.per_token = 0.010, 0.0005
    for i in range(16):
        s.add(seq(4000, name=f"score{i}", first=10_000 * i, kind=SequenceKind.SCORE))
    chunks, long_seconds, total = [], 0.0, 0.0
    for _ in range(steps):
        out = s.schedule()
        s.update(out)
        long = sum(
            s.costs.chunk_seconds(i.num_tokens, i.start) for i in out.scheduled if i.seq.kind is SequenceKind.SCORE
        )
        seconds = estimated_seconds(s, out) + (slower - 1.0) * long
        s.step_took(seconds)
        for item in out.scheduled:
            if item.seq.kind is SequenceKind.GENERATE:
                item.seq.token_ids.append(7)
        chunks.append({item.seq.request_id: item.num_tokens for item in out.scheduled})
        long_seconds, total = long_seconds + slower * long, total + seconds
    return chunks, long_seconds, total


def test_decodes_never_pause_and_long_work_beside_them_gets_its_share_in_a_few_full_steps() -> None:
    """Beside decodes that never pause, long work rides along on the time it earned (a quarter of the rest):
    one step in five carries a chunk that fills one join-stall room, the other four run the decodes alone,
    and long work gets a fifth of the engine's time."""
    s = make_fair(budget=2048, threshold=512, num_blocks=1100)  # room for one 4,000-token input beside the decodes
    steps, long_seconds, total = long_beside_decodes(s, 100)
    room = (3.0 - 1.0) * 0.010 * ROOM_MARGIN
    assert all(step[f"d{i}"] == 1 for step in steps for i in range(4))  # every decode, every step
    carried = [step for step in steps if any(name.startswith("score") for name in step)]
    assert all(list(step)[4:] == ["score0"] and step["score0"] == int(room / 0.0005) for step in carried)
    assert 18 <= len(carried) <= 21
    share = LONG_SHARE_BESIDE_INTERACTIVE / (1 + LONG_SHARE_BESIDE_INTERACTIVE)
    assert long_seconds / total == pytest.approx(share, rel=0.1)


def test_long_work_beside_decodes_is_charged_what_its_chunks_took_not_their_estimate() -> None:
    """Chunks that take three times their estimate (a deep chunk's cached keys read from memory) ride along
    a third as often: long work keeps its share of the measured time, and the decodes theirs."""
    s = make_fair(budget=2048, threshold=512, num_blocks=1100, alone_seconds=0.08)  # owed up to 80 ms
    steps, long_seconds, total = long_beside_decodes(s, 150, slower=3.0)
    carried = sum(1 for step in steps if "score0" in step)
    assert 8 <= carried <= 12
    share = LONG_SHARE_BESIDE_INTERACTIVE / (1 + LONG_SHARE_BESIDE_INTERACTIVE)
    assert long_seconds / total == pytest.approx(share, rel=0.15)


def test_a_long_classification_input_takes_the_long_slot_for_its_step() -> None:
    s = make_fair(budget=1000, threshold=32)
    s.add(seq(100, name="c0", kind=SequenceKind.CLASSIFY))
    s.add(seq(100, name="c1", kind=SequenceKind.CLASSIFY))
    s.add(seq(10, name="c2", kind=SequenceKind.CLASSIFY))
    assert run_step(s) == [("c2", 10), ("c0", 100)]  # whole (never chunked), one long input per step, after short


def test_deeper_long_chunks_cost_no_more_than_the_first_when_nothing_decodes() -> None:
    """Alone, a long prompt's chunk costs at most what long_prefill_chunk tokens cost from position 0: deeper
    chunks (each token reads more cached keys) get fewer tokens, so that a request arriving meanwhile waits
    at most one short step."""
    s = make_fair(budget=2048, threshold=64, num_blocks=1024)
    s.costs.decode_step, s.costs.per_token, s.costs.pair_ratio = 0.010, 0.0005, 0.01
    s.add(long := seq(1000, name="score", kind=SequenceKind.SCORE))
    bound = s.costs.chunk_seconds(64, 0)
    chunks = []
    for _ in range(8):
        start = long.num_computed_tokens
        (name, n), *others = run_step(s)
        assert not others and s.costs.chunk_seconds(n, start) <= bound + 1e-12
        chunks.append(n)
    assert chunks[0] == 64 and chunks == sorted(chunks, reverse=True) and chunks[-1] < 40


def test_long_prompts_alone_take_chunks_of_the_alone_step_time_and_shrink_when_a_request_arrives() -> None:
    """Bulk scoring alone keeps its throughput (chunks of long_prefill_alone_seconds, not of
    long_prefill_chunk tokens); a request that arrives is admitted in the next step, and long work yields."""
    s = make_fair(budget=2048, threshold=64, num_blocks=1024, alone_seconds=0.2)
    s.costs.decode_step, s.costs.per_token, s.costs.pair_ratio = 0.010, 0.0005, 0.01
    s.add(long := seq(3000, name="score", kind=SequenceKind.SCORE))
    while s._quiet_seconds < QUIET_SECONDS_BEFORE_LONG_CHUNKS:  # quiet steps (its admission first) still capped
        [(name, n)] = run_step(s)
        assert n <= 64
    start = long.num_computed_tokens
    (name, n), *others = run_step(s)
    assert name == "score" and not others and n > 64
    assert s.costs.chunk_seconds(n, start) <= 0.2 + 1e-12 < s.costs.chunk_seconds(n + 1, start)
    s.add(seq(5, name="short", first=9000))
    assert run_step(s) == [("short", 5)]  # long work yields: it earned nothing beside others yet


def test_quiet_time_before_long_chunks_is_measured_not_estimated() -> None:
    """Steps the cost model thinks cost 32 ms but that took 1 ms each are 1 ms of quiet apiece: a client's
    next request, 50 ms after its last, never meets a step of long_prefill_alone_seconds."""
    s = make_fair(budget=2048, threshold=64, num_blocks=8192, alone_seconds=0.2)
    s.costs.decode_step, s.costs.per_token, s.costs.pair_ratio = 0.010, 0.0005, 0.0001
    s.add(long := seq(20000, name="score", kind=SequenceKind.SCORE))
    capped = s.costs.chunk_seconds(64, 0)  # long_prefill_chunk tokens at the start of a prompt
    for _ in range(round(QUIET_SECONDS_BEFORE_LONG_CHUNKS * 1000) - 1):  # 1 ms short of the quiet time
        start = long.num_computed_tokens
        out = s.schedule()
        s.update(out)
        s.step_took(0.001)
        [item] = out.scheduled
        assert s.costs.chunk_seconds(item.num_tokens, start) <= capped + 1e-12
    s.step_took(0.001)  # the step just run ends the quiet time
    start = long.num_computed_tokens
    [(_, n)] = run_step(s)
    assert 3 * capped < s.costs.chunk_seconds(n, start) <= 0.2 + 1e-12


def test_a_short_request_admitted_beside_long_work_runs_its_first_steps_alone() -> None:
    """Long work that had the engine to itself has earned nothing beside others: the short request's steps
    run it alone until long work earns a room (six of them), and that step stays in the join-stall bound."""
    s = make_fair(budget=2048, threshold=64, num_blocks=1024)
    s.costs.decode_step, s.costs.per_token = 0.010, 0.0005
    s.add(seq(1000, name="score", kind=SequenceKind.SCORE))
    assert run_step(s) == [("score", 64)]  # alone: what 64 tokens cost
    s.add(seq(5, name="short", first=5000))
    steps = [run_step(s) for _ in range(8)]
    assert steps[0] == [("short", 5)] and all(step == [("short", 1)] for step in steps[1:6])
    room = (3.0 - 1.0) * 0.010 * ROOM_MARGIN  # beside one decode
    assert steps[6] == [("short", 1), ("score", int(room / 0.0005))] and steps[7] == [("short", 1)]


def test_deep_in_a_long_prompt_long_work_beside_decodes_takes_one_token_once_it_earned_a_room() -> None:
    """Deep in a long prompt one token reads 100 cached keys and costs more than a step's join-stall room:
    long work takes one token (never min_chunk: 16 tokens would stall the decode 16 times as long) once it
    has earned a room, and pays the rest back in the steps after; it still progresses."""
    s = make_fair(budget=2048, threshold=512)
    s.add(seq(3, name="d"))
    run_step(s)
    s.costs.decode_step, s.costs.per_token, s.costs.pair_ratio = 0.010, 0.0005, 0.3  # a key: 30 % of a token
    s.add(long := seq(1000, name="score", first=100, kind=SequenceKind.SCORE))
    for _ in range(1000):
        if long.num_computed_tokens >= 100:
            break
        assert dict(run_step(s))["d"] == 1
    assert long.num_computed_tokens >= 100
    assert s.costs.chunk_seconds(1, 100) > (3.0 - 1.0) * 0.010 * ROOM_MARGIN  # one token: over the room
    chunks = [dict(run_step(s)).get("score", 0) for _ in range(40)]
    assert set(chunks) == {0, 1} and 4 <= sum(chunks) <= 8


# ---- fair share under every request shape: many medium prompts in one request, batch work ----------------


def request(count: int, length: int, name: str, kind=SequenceKind.SCORE, background: bool = False) -> list[Sequence]:
    """One client request of `count` prompts of `length` distinct tokens, its prompts one work group."""
    group = WorkGroup(count * length, background)
    offset = sum(map(ord, name)) % 1000  # distinct tokens per request: no prefix-cache hits between them
    seqs = [seq(length, name=f"{name}{i}", first=100_000 * (i + 1) + offset, kind=kind) for i in range(count)]
    for s in seqs:
        s.group = group
    return seqs


def bulk(alone_seconds: float = 0.05, max_seqs: int = 64) -> Scheduler:
    """The server's defaults (2,048 tokens a step, long over 512, chunks of 128) on a cost model like the demos'
    on this machine: a decode step 4 ms, a prefilled token 30 us."""
    config = SchedulerConfig(max_seqs, 2048, long_prefill_alone_seconds=alone_seconds)
    s = Scheduler(config, BlockManager(40_000, BS, True))
    s.costs.decode_step, s.costs.per_token, s.costs.pair_ratio = 0.004, 0.00003, 0.0003
    return s


def engine_step(s: Scheduler) -> float:
    """One step as the engine runs it: a scored prompt finishes once computed, a completion gets a token (and
    the heavy completions of max_tokens 1 finish). -> the step's prefill seconds by the cost model."""
    out = s.schedule()
    s.update(out)
    s.step_took(estimated_seconds(s, out))
    for item in out.scheduled:
        if item.completes_prompt:
            if item.seq.kind is SequenceKind.SCORE or item.seq.request_id != "probe":
                s.finish(item.seq, "stop")
            else:
                item.seq.token_ids.append(7)
    return sum(s.costs.chunk_seconds(i.num_tokens, i.start) for i in out.scheduled if not i.is_decode)


def probe_joins(s: Scheduler) -> tuple[int, list[float]]:
    """A 6-token completion arrives: (steps until its prompt is prefilled, each step's prefill seconds until it
    has 4 tokens)."""
    s.add(probe := seq(6, name="probe", first=7))
    steps, seconds = None, []
    while probe.num_output_tokens < 4:
        seconds.append(engine_step(s))
        if steps is None and probe.num_output_tokens:
            steps = len(seconds)
        assert len(seconds) < 50
    assert steps is not None
    return steps, seconds


HOSTILE = {
    "completions 256 x 500": lambda: request(256, 500, "c", kind=SequenceKind.GENERATE),
    "score 256 x 510": lambda: request(256, 510, "s"),
    "score 256 x 512": lambda: request(256, 512, "t"),
    "score 16 x 4000": lambda: request(16, 4000, "u"),
    "batch 400 lines of 500": lambda: [x for i in range(400) for x in request(1, 500, f"b{i}-", background=True)],
    "four clients": lambda: [
        *request(256, 500, "c", kind=SequenceKind.GENERATE),
        *request(256, 510, "s"),
        *request(256, 512, "t"),
        *request(16, 4000, "u"),
    ],
}
# (The probe is named "probe"; every other completion is heavy work of max_tokens 1.)


@pytest.mark.parametrize("shape", HOSTILE)
def test_a_short_request_joins_any_heavy_shape_at_once_and_keeps_the_join_stall_bound(shape: str) -> None:
    """Heavy work of any shape queued first (and running a few steps): a short completion arriving is admitted
    in the next step, and every step until its fourth token prefills at most what the join stall allows
    beside one decode (or, the step that admits it, what long_prefill_chunk tokens cost)."""
    s = bulk()
    for x in HOSTILE[shape]():
        s.add(x)
    for _ in range(12):  # heavy work alone for a while: past the quiet steps, its chunks take the alone time
        engine_step(s)
    steps, seconds = probe_joins(s)
    assert steps == 1  # its whole prompt in the first step after it arrived
    beside_decode = s.costs.prefill_room(s.config.max_join_stall, 1)
    assert beside_decode is not None
    assert max(seconds) <= max(beside_decode, s.costs.chunk_seconds(s.config.long_prefill_chunk, 0)) + 1e-9


@pytest.mark.parametrize("shape", HOSTILE)
def test_heavy_work_alone_keeps_its_steps_full_and_short(shape: str) -> None:
    """Alone, heavy work of any shape runs steps of about long_prefill_alone_seconds (throughput: many prompts of
    one request in one step, as many as the time allows), never longer (a request arriving waits at most that)."""
    s = bulk()
    for x in HOSTILE[shape]():
        s.add(x)
    costs = [engine_step(s) for _ in range(60)]
    alone = s.config.long_prefill_alone_seconds
    assert max(costs) <= alone + s.costs.chunk_seconds(1, 4000) + 1e-9  # the step's first chunk may take 1 token more
    assert min(costs[45:]) >= 0.8 * alone  # and, past the quiet time, it uses its time
