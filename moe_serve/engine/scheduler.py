"""The scheduler: each step, which sequences run and how many of their tokens, under a token budget.

Policy (vLLM's, with one addition):
- Running sequences first, in arrival order: a decode costs one token; a prompt still being prefilled gets
  the next chunk. Then waiting sequences, first come first served, admitted only if their blocks fit.
- When blocks run out, the most recently admitted running sequence is preempted: its blocks are freed and
  it is recomputed later (its full blocks usually come back from the prefix cache).
- While decodes run, a prompt's chunk is sized so that the step costs at most `max_join_stall` decode steps
  (engine.step_costs.StepCosts: seconds per decode step, measured online; a chunk's seconds from its tokens
  and their attention context, both rates calibrated at start-up and refitted online), so a long prompt
  joining never stalls the decodes; with nothing decoding, chunks take the whole budget.
- Long prompts share the engine (vLLM's partial-prefill limits): a prompt of more than
  `long_prefill_threshold` tokens is long while it is prefilled. At most `max_long_prefills` long prompts are
  in progress at once; a long prompt waiting behind them is skipped, not admitted, so that the short requests
  queued behind it (a completion behind the 16 inputs of one /v1/score) are admitted at once. A long prompt's
  chunk is at most `long_prefill_chunk` tokens and, deeper in the prompt, at most what they cost from its
  start (beside decodes, or a request admitted in the same step: the join-stall room, down to one token), so
  that a step stays short even when nothing decodes and a newly arrived request waits at most one short step;
  long chunks take what the step has left after the decodes, the short prompts and the admissions. When long
  prompts are all a step runs (bulk scoring), their chunk may cost `long_prefill_alone_seconds` instead: as
  fast as before the limits (per-step overhead is a few ms), and a request arriving meanwhile waits at most
  that long for the step in flight.
- Classification inputs need their whole input in one step (bidirectional attention): they run when they
  fit the budget and take no KV blocks; a long one (whole, it cannot be capped) takes a long slot for its step.
Nothing here touches tensors: the scheduler unit-tests without a model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

from moe_serve.engine.block_manager import BlockManager
from moe_serve.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from moe_serve.engine.sequence import Sequence, SequenceKind, SequenceStatus
from moe_serve.engine.step_costs import StepCosts

# Steps of long prompts alone before their chunks may take long_prefill_alone_seconds: about 0.1-0.2 s of
# capped steps, longer than the gap between a client's one request and its next.
QUIET_STEPS_BEFORE_LONG_CHUNKS = 8


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int  # sequences in one step
    max_num_batched_tokens: int  # tokens in one step
    max_join_stall: float = 3.0  # a step with prefill costs at most this many decode steps (while decoding)
    min_chunk: int = 16  # smallest prefill chunk, so that a prompt always progresses
    long_prefill_threshold: int = 512  # a longer prompt is long while it is prefilled
    long_prefill_chunk: int = 128  # a long prompt's chunk: at most this many tokens, and what they cost from 0
    max_long_prefills: int = 1  # long prompts in progress at once (more wait, skipped by shorter ones)
    # When long prompts are all a step runs, their chunks may cost this many seconds (bulk scoring keeps its
    # throughput; a request arriving meanwhile waits at most this long for the step in flight).
    long_prefill_alone_seconds: float = 0.2


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.costs = StepCosts()
        self._quiet_steps = 0  # consecutive steps that ran long prompts only
        self._budget = 0  # tokens left in the step being scheduled
        self._room: float | None = None  # seconds of prefill left beside its decodes (None: nothing decodes)
        self._long_room: float | None = None  # seconds left to long chunks when nothing decodes

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def is_long(self, seq: Sequence, start: int | None = None) -> bool:
        """A prompt of more than `long_prefill_threshold` tokens still being prefilled from `start` (default: what it
        computed so far). Long by its length, not by what is left: a chunk late in a long prompt (or after a
        long cached prefix) reads that many cached keys per token, and costs more the deeper it is."""
        computed = seq.num_computed_tokens if start is None else start
        return seq.num_tokens > self.config.long_prefill_threshold and computed < seq.num_tokens - 1

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        num_decodes = sum(1 for s in self.running if s.num_computed_tokens >= s.num_tokens - 1)
        # Seconds of prefill this step may spend beside the decodes (None: nothing decodes).
        self._room = self.costs.prefill_room(self.config.max_join_stall, num_decodes)
        # When nothing else runs, a long chunk costs at most what long_prefill_chunk tokens cost at the start of a
        # prompt: deeper chunks get fewer tokens, so a request arriving meanwhile waits at most one such step
        # (None: the costs are not known yet; the token cap alone bounds the chunk then).
        self._long_room = None
        self._long_alone = False  # set while long prompts are all this step runs
        if self.costs.per_token:  # (1 + 1e-9): so that long_prefill_chunk tokens fit at position 0, despite rounding
            self._long_room = self.costs.chunk_seconds(self.config.long_prefill_chunk, 0) * (1 + 1e-9)
        self._budget = self.config.max_num_batched_tokens
        # Long prompts in progress go last: their chunks take what decodes, short prompts and admissions leave.
        longs = [seq for seq in self.running if self.is_long(seq)]
        self._run([seq for seq in self.running if not self.is_long(seq)], out)
        self._admit(self.config.max_long_prefills - len(longs), out)
        # Long prompts alone for a while (a client sending request after request leaves no such gap): longer
        # chunks, fewer steps. The first quiet steps stay short, so a request following its predecessor
        # within a few steps never meets a long one.
        self._quiet_steps = self._quiet_steps + 1 if not out.scheduled else 0
        if self._quiet_steps > QUIET_STEPS_BEFORE_LONG_CHUNKS and self._long_room is not None:
            self._long_room = max(self._long_room, self.config.long_prefill_alone_seconds)
            self._long_alone = True
        self._run(longs, out)
        self._long_alone = False
        return out

    def _run(self, seqs: list[Sequence], out: SchedulerOutput) -> None:
        """The next chunk (or decode) of running sequences, in order, while the budget lasts."""
        for seq in seqs:
            if self._budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this step
                continue
            n = self._fit(min(seq.num_tokens - seq.num_computed_tokens, self._budget), seq.num_computed_tokens, seq)
            if not self._reserve(seq, n, out):
                continue
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, n))
            self._budget -= n

    def _admit(self, long_slots: int, out: SchedulerOutput) -> None:
        """Waiting sequences, first come first served, while blocks, budget and sequence slots last; a long
        prompt while no long slot is free is skipped (it keeps its place at the head of the queue)."""
        skipped: list[Sequence] = []
        while self.waiting and self._budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.kind is SequenceKind.CLASSIFY:
                long = self.is_long(seq, 0)
                if long and long_slots <= 0:
                    skipped.append(self.waiting.popleft())
                    continue
                if seq.num_tokens > self._budget:
                    break
                n = seq.num_tokens
            else:
                cached = self.blocks.no_prefix() if seq.needs_prompt_logits else self.blocks.cached_prefix(seq)
                start = cached.num_blocks * self.blocks.block_size
                long = self.is_long(seq, start)
                if long and long_slots <= 0:
                    skipped.append(self.waiting.popleft())
                    continue
                n = self._fit(min(seq.num_tokens - start, self._budget), start, seq)
                if not self.blocks.can_allocate(seq, start + n, cached):
                    break
                self.blocks.allocate(seq, start + n, cached)
            long_slots -= long
            beside = self.costs.prefill_room(self.config.max_join_stall, 1)
            if not long and self._long_room is not None and beside is not None:
                # It decodes from its next step: long chunks keep this step as short as if it did already.
                self._long_room = min(self._long_room, beside)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, n))
            self._budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _fit(self, n: int, start: int, seq: Sequence) -> int:
        """The chunk of at most n tokens from `start` that `seq` runs this step. Under the join-stall room
        while others decode (never fewer than min_chunk tokens, so that a prompt always progresses). A long
        prompt's chunk: at most `long_prefill_chunk` tokens, and under the room too, beside decodes (or a short prompt
        admitted this step) or, when nothing else runs, what long_prefill_chunk tokens cost from position 0; at least
        one token (late in a long prompt even min_chunk tokens can cost many decode steps: each token reads
        thousands of cached keys)."""
        if n <= 1:  # a decode
            return n
        if not self.is_long(seq, start):
            if self._room is not None:
                n, self._room = self._chunk(n, start, self._room)
            return n
        if not self._long_alone:
            n = min(n, self.config.long_prefill_chunk)
        decoding = self._room is not None
        room = self._room if decoding else self._long_room
        if room is None:  # costs not known yet: the token cap alone
            return n
        n = max(min(n, self.costs.tokens_within(room, start)), 1)
        left = max(room - self.costs.chunk_seconds(n, start), 0.0)
        if decoding:
            self._room = left
        else:
            self._long_room = left
        return n

    def _chunk(self, n: int, start: int, room: float) -> tuple[int, float]:
        """At most n tokens from `start` that fit `room` seconds (never fewer than min_chunk), and the room left."""
        n = max(min(n, self.costs.tokens_within(room, start)), min(n, self.config.min_chunk))
        return n, max(room - self.costs.chunk_seconds(n, start), 0.0)

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Blocks for n more tokens of a running sequence, preempting the latest admitted ones if needed."""
        while not self.blocks.can_append(seq, n):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        self.blocks.append(seq, n)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def update(self, output: SchedulerOutput, failed: Collection[Sequence] = ()) -> None:
        """After the runner computed a step: advance each sequence and publish its full blocks; the `failed`
        ones (about to be finished with an error) are left as they are, their blocks unpublished."""
        for item in output.scheduled:
            seq = item.seq
            if seq in failed:
                continue
            seq.num_computed_tokens = item.end
            if seq.uses_kv_cache:
                self.blocks.commit(seq)
                self.blocks.release_unreachable(seq)

    def finish(self, seq: Sequence, reason: str, error: BaseException | None = None) -> None:
        """End a sequence (stop, length, abort, error) and give its blocks back, wherever it is."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_tables:
            self.blocks.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
