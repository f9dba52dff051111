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
  `long_prefill_threshold` tokens (or of a request whose prompts have that many together, or of background
  work) is long while it is prefilled. At most `max_long_prefills` pieces of long work are in progress at
  once; long work waiting behind them is skipped, not admitted, so that the short requests queued behind it
  (a completion behind the 16 inputs of one /v1/score) are admitted at once. Long work goes after the
  decodes, the short prompts and the admissions. Alone, a long prompt's chunk is at most `long_prefill_chunk`
  tokens and, deeper in the prompt, at most what they cost from its start, so that a newly arrived request
  waits at most one short step; after a while of that (bulk scoring), `long_prefill_alone_seconds`: as fast
  as before the limits, and a request arriving meanwhile waits at most that long for the step in flight.
  Beside interactive work, long work rides along only on time it has earned (a quarter of the interactive
  steps' measured seconds, spent by its steps' measured extra seconds), within the join-stall room: it keeps
  progressing under a stream that never pauses, and a short request's few steps rarely carry it.
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

# Seconds of long work alone (by the cost model: capped steps, each a few ms) before its chunks may take
# long_prefill_alone_seconds: longer than the gap between an interactive client's one request and its next, so
# a client sending request after request finds short steps, never one of the long ones.
QUIET_SECONDS_BEFORE_LONG_CHUNKS = 0.1
# Beside interactive work (decodes, short prompts), long work earns this share of the interactive steps' measured
# time and rides along only on what it has earned, each carrying step charged its measured extra seconds: it
# progresses at about a fifth of the engine's time while interactive streams never pause, and a short request's
# few steps rarely carry any of it. (A share of every step's room instead put one deep token into each of them:
# 2-3 ms apiece at 2,000 cached keys on the demo model, a 4-token completion 3.3x its time alone.)
LONG_SHARE_BESIDE_INTERACTIVE = 0.25
BACKGROUND = object()  # the long slot all background work shares


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
    long_prefill_alone_seconds: float = 0.08


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.costs = StepCosts()
        self._quiet_seconds = 0.0  # measured seconds of the consecutive steps that ran long work only
        self._quiet_step = False  # the step last scheduled runs long work only
        self._budget = 0  # tokens left in the step being scheduled
        self._room: float | None = None  # seconds of prefill left beside its decodes (None: nothing decodes)
        self._long_room: float | None = None  # seconds left to this step's long chunks (None: the token cap alone)
        self._long_credit = 0.0  # seconds long work has earned beside interactive work (negative: owed)
        self._credit_cap = 0.0  # the most it may hold: one step's join-stall room
        self._interactive_seconds = 0.0  # this step's estimated seconds without its long chunks
        self._long_beside = False  # this step carries long chunks beside interactive work
        self._long_alone = False  # this step runs long work alone, after quiet steps
        self._long_scheduled = False  # a long chunk is in this step already
        self._blocked = False  # admission met a sequence its blocks (or a whole classified input) did not fit

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_waiting_long(self) -> int:
        """Waiting sequences of long work (their own prompt, or their group's, long; or background)."""
        return sum(self._long_work(seq) for seq in self.waiting)

    def is_long(self, seq: Sequence, start: int | None = None) -> bool:
        """Long work, while it is prefilled from `start` (default: what it computed so far): a prompt of more
        than `long_prefill_threshold` tokens, a prompt of a work group whose prompts together have more (256
        prompts of 500 tokens in one request are 128,000 tokens of prefill, as one long prompt would be), or
        a prompt of background work (a batch file's lines). Long by its length, not by what is left: a chunk
        late in a long prompt (or after a long cached prefix) reads that many cached keys per token, and costs
        more the deeper it is."""
        computed = seq.num_computed_tokens if start is None else start
        return computed < seq.num_prompt_tokens and self._long_work(seq)

    def _long_work(self, seq: Sequence) -> bool:
        threshold = self.config.long_prefill_threshold
        return seq.num_tokens > threshold or (seq.group is not None and seq.group.is_long(threshold))

    @staticmethod
    def _work(seq: Sequence) -> object:
        """What a long slot holds: the sequence's work group (all of its prompts prefill as one piece of
        work), all background work together (a batch file's lines fill one slot's steps, as the engine batched
        them before), or the sequence itself when it has no group."""
        if seq.group is None:
            return seq
        return BACKGROUND if seq.group.background else seq.group

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # Sequences that generate (a prompt's last token is still prefill: a scored input never decodes).
        num_decodes = sum(1 for s in self.running if s.num_output_tokens and s.num_computed_tokens >= s.num_tokens - 1)
        # Seconds of prefill this step may spend beside the decodes (None: nothing decodes).
        self._room = self.costs.prefill_room(self.config.max_join_stall, num_decodes)
        self._long_room = None  # set by _room_alone or _room_beside, once short work is scheduled
        self._long_alone = False  # set while long work is all this step runs
        self._budget = self.config.max_num_batched_tokens
        self._long_scheduled = False
        self._blocked = False
        # Short work first, every step: decodes and short prompts running, then short requests waiting, first
        # come first served. Long work goes last: its chunks take what they leave, within the long room.
        longs = [seq for seq in self.running if self.is_long(seq)]
        self._run([seq for seq in self.running if not self.is_long(seq)], out)
        self._admit(out, long=False)
        quiet = not out.scheduled
        if quiet:
            self._long_credit = 0.0  # long work has the engine: what it earned beside others is spent
            runs_long = self._room_alone()
        else:
            runs_long = self._room_beside(out, longs)
        if runs_long:
            self._run(longs, out, long=True)
            self._admit(out, long=True)
        self._long_alone = False
        self._long_beside = not quiet and self._long_scheduled
        self._quiet_step = quiet
        if not quiet:
            self._quiet_seconds = 0.0
        return out

    def _room_alone(self) -> bool:
        """The long room of a step that runs long work only: what long_prefill_chunk tokens cost at the start of a
        prompt (deeper chunks get fewer tokens, so a request arriving meanwhile waits at most one such step), or,
        after QUIET_SECONDS_BEFORE_LONG_CHUNKS of such steps (a client sending request after request leaves no
        such gap), long_prefill_alone_seconds: longer chunks, fewer steps. -> True (long work runs)."""
        if not self.costs.per_token:  # the costs are not known yet: the token cap alone bounds the chunk
            return True
        # (1 + 1e-9): so that long_prefill_chunk tokens fit at position 0, despite rounding
        self._long_room = self.costs.start_chunk_seconds(self.config.long_prefill_chunk) * (1 + 1e-9)
        if self._quiet_seconds >= QUIET_SECONDS_BEFORE_LONG_CHUNKS:
            # The step's own overhead is part of its time: its chunks get the rest.
            alone = self.config.long_prefill_alone_seconds - self.costs.step_overhead
            self._long_room = max(self._long_room, alone)
            self._long_alone = True
        return True

    def _room_beside(self, out: SchedulerOutput, longs: list[Sequence]) -> bool:
        """Whether long work rides along in a step of interactive work, and its room there. It earns a share of
        the interactive steps' time (LONG_SHARE_BESIDE_INTERACTIVE, up to one step's join-stall room) and rides
        once it has earned a whole room, within what the short work left of this step's: a few steps in
        several carry one chunk that fills the room, the others run interactive work alone (and a 4-token
        completion's few steps, none). Deep in a long prompt, where one token costs more than the room, it
        takes that token once the room is earned, and pays the rest back in the steps after. -> False: not
        this step."""
        costs = self.costs
        if not costs.per_token:  # the costs are not known yet: the token cap alone bounds the chunk
            return True
        self._interactive_seconds = sum(
            costs.chunk_seconds(i.num_tokens, i.start) for i in out.scheduled if not i.is_decode
        )
        self._interactive_seconds += (costs.decode_step or 0.0) if out.num_decodes else costs.step_overhead
        # One step's join-stall room, beside one decode (a short request admitted now decodes from its next step).
        cap = costs.prefill_room(self.config.max_join_stall, 1)
        self._credit_cap = cap if cap is not None else costs.start_chunk_seconds(self.config.long_prefill_chunk)
        room = self._credit_cap if self._room is None else min(self._credit_cap, self._room)
        depth = longs[0].num_computed_tokens if longs else 0
        if self._long_credit < self._credit_cap * (1 - 1e-9) or room < min(
            costs.chunk_seconds(1, depth), self._credit_cap
        ):
            return False
        self._long_room = room
        return True

    def step_took(self, seconds: float) -> None:
        """The measured seconds of the step last scheduled. Quiet time is counted in measured seconds, not by
        the cost model: where the model overestimated capped steps, 0.1 s of them by its count passed in less
        than a client's gap between requests, and its next request met a step of long_prefill_alone_seconds
        (probe maxima of 16x in benchmarks/fair_share.py). Long work's credit beside interactive work too: a
        step that carried long chunks is charged what it took beyond its interactive work's estimate (the long
        chunks' own estimate may be far off), and every interactive step earns the share of the rest of its
        seconds. The debt is bounded by the longest step the scheduler plans (long_prefill_alone_seconds, or one
        room): a step slower than that was slowed by something else (a collection, the machine), and must not
        hold long work back for many."""
        if self._quiet_step:
            self._quiet_seconds += seconds
            return
        spent = max(seconds - self._interactive_seconds, 0.0) if self._long_beside else 0.0
        credit = self._long_credit - spent + LONG_SHARE_BESIDE_INTERACTIVE * (seconds - spent)
        debt = max(self._credit_cap, self.config.long_prefill_alone_seconds)
        self._long_credit = min(max(credit, -debt), self._credit_cap)

    def _run(self, seqs: list[Sequence], out: SchedulerOutput, long: bool = False) -> None:
        """The next chunk (or decode) of running sequences, in order, while the budget lasts (and, for long
        work, the long room: once it is spent the step's first long chunk is the only one)."""
        for seq in seqs:
            if self._budget <= 0 or (long and self._long_room_spent()):
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this step
                continue
            n = self._fit(min(seq.num_tokens - seq.num_computed_tokens, self._budget), seq.num_computed_tokens, seq)
            if n == 0:  # long work the room holds no more of this step
                break
            if not self._reserve(seq, n, out):
                continue
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, n))
            self._budget -= n
            self._long_scheduled |= long

    def _long_room_spent(self) -> bool:
        """Whether long work has had its share of this step: at least one long chunk ran, and its room is gone."""
        return self._long_scheduled and self._long_room is not None and self._long_room <= 0.0

    def _admit(self, out: SchedulerOutput, long: bool) -> None:
        """Waiting sequences of one class (short, or long work), first come first served, while blocks, budget
        and sequence slots last; the other class's sequences keep their places. Long work needs a long slot
        (max_long_prefills pieces of long work in progress at once; a work group's sequences share one): a long
        sequence without one is skipped, so short requests behind it are never held back by it."""
        in_progress = {id(self._work(seq)) for seq in self.running if self.is_long(seq)}
        # Long work is admitted only where its whole prompt fits beside what the long prefills in progress still
        # need: several prompts of one request prefilling at once never run the cache out and preempt each other.
        reserved = sum(self.blocks.blocks_to_finish(seq) for seq in self.running if self.is_long(seq)) if long else 0
        kept: list[Sequence] = []
        while self.waiting:
            seq = self.waiting.popleft()
            stop = (
                self._blocked
                or self._budget <= 0
                or bool(out.preempted)
                or len(self.running) >= self.config.max_num_seqs
                or (long and self._long_room_spent())
            )
            if stop:
                kept.append(seq)
                kept.extend(self.waiting)
                self.waiting.clear()
                break
            # The class first, before any prefix lookup (each hashes the prompt's blocks): a prompt that has
            # generated nothing is long work exactly when its work is (a prefix hit never takes its last token).
            long_work = self._long_work(seq)
            if (long and not long_work) or (not long and long_work and not seq.num_output_tokens):
                kept.append(seq)
                continue
            start = 0 if seq.kind is SequenceKind.CLASSIFY else None
            cached = None
            if start is None:
                cached = self.blocks.no_prefix() if seq.needs_prompt_logits else self.blocks.cached_prefix(seq)
                start = cached.num_blocks * self.blocks.block_size
            is_long = self.is_long(seq, start)
            work = id(self._work(seq))
            if is_long != long or (
                long and work not in in_progress and len(in_progress) >= self.config.max_long_prefills
            ):
                kept.append(seq)  # the other class, or long work without a slot: it keeps its place
                continue
            if seq.kind is SequenceKind.CLASSIFY:
                if seq.num_tokens > self._budget:  # read whole: it waits for a step with room (in order)
                    self._blocked = True
                    kept.append(seq)
                    continue
                n = seq.num_tokens
            else:
                assert cached is not None
                if long and not self.blocks.can_allocate(seq, seq.num_tokens, cached, reserved):
                    self._blocked = True
                    kept.append(seq)
                    continue
                n = self._fit(min(seq.num_tokens - start, self._budget), start, seq)
                if n == 0:  # long work the room holds no more of this step: it keeps its place
                    kept.append(seq)
                    kept.extend(self.waiting)
                    self.waiting.clear()
                    break
                if not self.blocks.can_allocate(seq, start + n, cached):
                    self._blocked = True
                    kept.append(seq)
                    continue
                self.blocks.allocate(seq, start + n, cached)
            if long:
                in_progress.add(work)
                self._long_scheduled = True
                reserved += self.blocks.blocks_to_finish(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, n))
            self._budget -= n
        self.waiting.extendleft(reversed(kept))

    def _fit(self, n: int, start: int, seq: Sequence) -> int:
        """The chunk of at most n tokens from `start` that `seq` runs this step. Under the join-stall room
        while others decode (never fewer than min_chunk tokens, so that a prompt always progresses). A long
        prompt's chunk: at most `long_prefill_chunk` tokens (unless long work runs alone after the quiet time),
        and under the step's long room (_room_alone, _room_beside). The step's first long chunk takes at least
        one token (late in a long prompt even min_chunk tokens can cost many decode steps: each token reads
        thousands of cached keys), so long work always progresses; a later one takes what the room still
        holds, none when it holds no token (0: the sequence waits for the next step)."""
        if n <= 1:  # a decode
            return n
        if not self.is_long(seq, start):
            if self._room is not None:
                n, self._room = self._chunk(n, start, self._room)
            return n
        if not self._long_alone:
            n = min(n, self.config.long_prefill_chunk)
        if self._long_room is None:  # costs not known yet: the token cap alone
            return n
        n = min(n, self.costs.tokens_within(self._long_room, start))
        if n == 0 and not self._long_scheduled:
            n = 1
        self._long_room = max(self._long_room - self.costs.chunk_seconds(n, start), 0.0)
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
