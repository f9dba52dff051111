"""The scheduler: each step, which sequences run and how many of their tokens, under a token budget.

Policy (vLLM's, with one addition):
- Running sequences first, in arrival order: a decode costs one token; a prompt still being prefilled gets
  the next chunk. Then waiting sequences, first come first served, admitted only if their blocks fit.
- When blocks run out, the most recently admitted running sequence is preempted: its blocks are freed and
  it is recomputed later (its full blocks usually come back from the prefix cache).
- While decodes run, a prompt's chunk is sized so that the step costs at most `max_join_stall` decode steps
  (StepCosts: seconds per decode step, measured online; a chunk's seconds from its tokens and their
  attention context, both rates calibrated at start-up and refitted online), so a long prompt
  joining never stalls the decodes; with nothing decoding, chunks take the whole budget.
- Classification inputs need their whole input in one step (bidirectional attention): they run when they
  fit the budget and take no KV blocks.
Nothing here touches tensors: the scheduler unit-tests without a model.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from moe_serve.engine.block_manager import BlockManager
from moe_serve.engine.sequence import Sequence, SequenceKind, SequenceStatus

# Chunks aim this far under the stall bound: a chunk's cost is an estimate, and the bound is a promise about
# the longest step. On the 2-vCPU development VM a plain decode step alone runs 1.2-1.5x its median at the
# 90th-99th percentile, so the estimate needs that much room: at 0.7 a 512-token prompt joining 16 tiny
# decodes measured 2.5-3.5 decode steps, repetition to repetition, against the bound of 3.
ROOM_MARGIN = 0.6


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int  # sequences in one step
    max_num_batched_tokens: int  # tokens in one step
    max_join_stall: float = 3.0  # a step with prefill costs at most this many decode steps (while decoding)
    min_chunk: int = 16  # smallest prefill chunk, so that a prompt always progresses


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    start: int  # first token of this step's chunk (= tokens already computed)
    num_tokens: int  # tokens computed this step
    # Fixed when scheduled: after the step the sequence has grown, and the step's costs are observed then.
    is_decode: bool = field(init=False)

    def __post_init__(self) -> None:
        self.is_decode = self.start == self.seq.num_tokens - 1 and self.seq.num_output_tokens > 0

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def completes_prompt(self) -> bool:
        """After this step every token of the sequence has been computed: it needs a next token."""
        return self.end == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if not s.is_decode)

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if s.is_decode)


class StepCosts:
    """What steps cost, from measured steps. A decode-only step: measured online. A prefill chunk of n
    tokens starting at position s: n * per_token + n * (s + n / 2) * per_pair, the second term its attention
    (each token reads s + its index keys). A per-token average alone would let a long prompt's first chunk
    stall the decodes: its tokens cost more than the short prompts' the average was learned from.

    Both rates are fitted online, by least squares over the measured prefill steps with older steps
    forgotten (weight FORGET per step), starting from the shape `calibrate` measured at start-up. The
    start-up shape alone is not enough: it times cache-free prompts from position 0, while a joining
    prompt's later chunks attend over the paged cache, which costs more per key (tiny benchmark model:
    calibrated per_pair / per_token ~0.0003, measured ~0.001, and the last chunks of a 512-token prompt
    ran 10-20% over their estimate)."""

    FORGET = 0.8  # an observation's weight after each newer one (the EMA weight of a new one: 0.2)
    ANCHOR = 0.01  # pull towards the current rates, relative to the data's own weight

    def __init__(self) -> None:
        self.decode_step: float | None = None  # seconds per step that only decodes
        self.per_token: float | None = None  # seconds per prefilled token, at context 0
        self.pair_ratio = 0.0  # per_pair / per_token
        # Forgetting sums of the normal equations of seconds ~ per_token * tokens + per_pair * pairs:
        # tokens^2, tokens * pairs, pairs^2, tokens * seconds, pairs * seconds.
        self._sums = [0.0] * 5

    def calibrate(self, seconds_for: Callable[[int], float], short: int, long: int) -> None:
        """The shape from two timed prompts, `short` and `long` tokens, each from position 0."""
        if long <= short:
            return
        per_short, per_long = seconds_for(short) / short, seconds_for(long) / long
        per_pair = max(2.0 * (per_long - per_short) / (long - short), 0.0)
        self.per_token = max(per_short - per_pair * short / 2, per_short / 2)
        self.pair_ratio = per_pair / self.per_token

    def chunk_seconds(self, n: int, start: int) -> float:
        assert self.per_token is not None
        return n * self.per_token * (1.0 + self.pair_ratio * (start + n / 2))

    def tokens_within(self, seconds: float, start: int) -> int:
        """The most prefill tokens from position `start` that cost at most `seconds`."""
        assert self.per_token is not None
        a = self.per_token * (1.0 + self.pair_ratio * start)
        b = self.per_token * self.pair_ratio  # n * (a + b * n / 2) <= seconds
        if b == 0.0:
            return int(seconds / a)
        return int((-a + math.sqrt(a * a + 2.0 * b * seconds)) / b)

    def observe(self, output: SchedulerOutput, seconds: float) -> None:
        prefill, decodes = output.num_prefill_tokens, output.num_decodes
        if prefill == 0:
            self.decode_step = ema(self.decode_step, seconds)
            return
        if decodes and self.decode_step is None:
            return
        prefill_seconds = max(seconds - (self.decode_step if decodes else 0.0), 0.0)
        chunks = [(s.num_tokens, s.start) for s in output.scheduled if not s.is_decode]
        self._fit(sum(n for n, _ in chunks), sum(n * (start + n / 2) for n, start in chunks), prefill_seconds)

    def _fit(self, tokens: float, pairs: float, seconds: float) -> None:
        """Add one step to the forgetting least-squares fit and re-solve for both rates."""
        terms = (tokens * tokens, tokens * pairs, pairs * pairs, tokens * seconds, pairs * seconds)
        self._sums = [self.FORGET * old + new for old, new in zip(self._sums, terms, strict=True)]
        if self.per_token is None:  # no calibration (stateful routers): the first step gives the level
            self.per_token = seconds / tokens
        # (G + a D) rates = rhs + a D current, D = diag(G): where the steps so far do not tell the two rates
        # apart (every chunk at the same context), the rates stay near the current ones instead of
        # swinging along the line the data leave open.
        g11, g12, g22, r1, r2 = self._sums
        d1, d2 = self.ANCHOR * g11, self.ANCHOR * g22
        a11, a22 = g11 + d1, g22 + d2
        r1, r2 = r1 + d1 * self.per_token, r2 + d2 * self.per_token * self.pair_ratio
        det = a11 * a22 - g12 * g12
        per_token, per_pair = (r1 * a22 - g12 * r2) / det, (a11 * r2 - g12 * r1) / det
        if per_pair < 0.0:  # attention never makes tokens cheaper: refit the level alone
            per_token, per_pair = r1 / a11, 0.0
        if per_token <= 0.0:  # noise in tiny steps: keep the last positive rates
            return
        self.per_token, self.pair_ratio = per_token, per_pair / per_token

    def prefill_room(self, max_stall: float, num_decodes: int) -> float | None:
        """Seconds of prefill a step with decodes may spend and stay under max_stall decode steps (None:
        nothing decodes, or the costs are not known yet)."""
        if not num_decodes or self.decode_step is None or not self.per_token:
            return None
        return (max_stall - 1.0) * self.decode_step * ROOM_MARGIN


def ema(old: float | None, new: float, weight: float = 0.2) -> float:
    """Exponential moving average: `new` weighs `weight`; the first value starts it."""
    return new if old is None else (1 - weight) * old + weight * new


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.costs = StepCosts()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        num_decodes = sum(1 for s in self.running if s.num_computed_tokens >= s.num_tokens - 1)
        room = self.costs.prefill_room(self.config.max_join_stall, num_decodes)  # seconds

        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n > 1 and room is not None:  # a prompt chunk while others decode
                n, room = self._chunk(n, seq.num_computed_tokens, room)
            if not self._reserve(seq, n, out):
                continue
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, n))
            budget -= n

        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.kind is SequenceKind.CLASSIFY:
                if seq.num_tokens > budget:
                    break
                n, cached = seq.num_tokens, []
            else:
                cached = [] if seq.needs_prompt_logits else self.blocks.cached_prefix(seq)
                start = len(cached) * self.blocks.block_size
                n = min(seq.num_tokens - start, budget)
                if room is not None:
                    n, room = self._chunk(n, start, room)
                if not self.blocks.can_allocate(seq, start + n, cached):
                    break
                self.blocks.allocate(seq, start + n, cached)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, n))
            budget -= n
        return out

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

    def update(self, output: SchedulerOutput) -> None:
        """After the runner computed a step: advance each sequence and publish its full blocks."""
        for item in output.scheduled:
            seq = item.seq
            seq.num_computed_tokens = item.end
            if seq.uses_kv_cache:
                self.blocks.commit(seq)

    def finish(self, seq: Sequence, reason: str, error: BaseException | None = None) -> None:
        """End a sequence (stop, length, abort, error) and give its blocks back, wherever it is."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.blocks.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
