"""The scheduler: each step, which sequences run and how many of their tokens, under a token budget.

Policy (vLLM's, with one addition):
- Running sequences first, in arrival order: a decode costs one token; a prompt still being prefilled gets
  the next chunk. Then waiting sequences, first come first served, admitted only if their blocks fit.
- When blocks run out, the most recently admitted running sequence is preempted: its blocks are freed and
  it is recomputed later (its full blocks usually come back from the prefix cache).
- While decodes run, a prompt's chunk is sized so that the step costs at most `max_join_stall` decode steps
  (measured online: seconds per decode step and per prefilled token), so a long prompt joining never
  stalls the decodes; with nothing decoding, chunks take the whole budget.
- Classification inputs need their whole input in one step (bidirectional attention): they run when they
  fit the budget and take no KV blocks.
Nothing here touches tensors: the scheduler unit-tests without a model.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from moe_serve.engine.block_manager import BlockManager
from moe_serve.engine.sequence import Sequence, SequenceKind, SequenceStatus


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

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def is_decode(self) -> bool:
        return self.start == self.seq.num_tokens - 1 and self.seq.num_output_tokens > 0

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
    """Running estimates of what a decode step and a prefilled token cost, from measured steps."""

    def __init__(self) -> None:
        self.decode_step: float | None = None  # seconds per step that only decodes
        self.per_token: float | None = None  # seconds per prefilled token

    def observe(self, output: SchedulerOutput, seconds: float) -> None:
        prefill, decodes = output.num_prefill_tokens, output.num_decodes
        if prefill == 0:
            self.decode_step = _ema(self.decode_step, seconds)
        elif decodes == 0:
            self.per_token = _ema(self.per_token, seconds / prefill)
        elif self.decode_step is not None:
            self.per_token = _ema(self.per_token, max(seconds - self.decode_step, 0.0) / prefill)

    def chunk_limit(self, max_stall: float, num_decodes: int) -> int | None:
        """Prefill tokens that keep a step with decodes under max_stall decode steps (None: unknown)."""
        if not num_decodes or self.decode_step is None or not self.per_token:
            return None
        return int((max_stall - 1.0) * self.decode_step / self.per_token)


def _ema(old: float | None, new: float, weight: float = 0.2) -> float:
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
        prefill_room = self.costs.chunk_limit(self.config.max_join_stall, num_decodes)

        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n > 1 and prefill_room is not None:  # a prompt chunk while others decode
                n = max(min(n, prefill_room), min(n, self.config.min_chunk))
                prefill_room = max(prefill_room - n, 0)
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
                n = min(seq.num_tokens - len(cached) * self.blocks.block_size, budget)
                if prefill_room is not None:
                    n = max(min(n, prefill_room), min(n, self.config.min_chunk))
                    prefill_room = max(prefill_room - n, 0)
                start = len(cached) * self.blocks.block_size
                if not self.blocks.can_allocate(seq, start + n, cached):
                    break
                self.blocks.allocate(seq, start + n, cached)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, n))
            budget -= n
        return out

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
