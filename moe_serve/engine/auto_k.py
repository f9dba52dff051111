"""experts_per_token "auto": the k that requests asking for it run with, chosen each step so that the
measured inter-token latency stays under the server's target (--target-itl-ms) at the current load.

The engine reports every step (`observe`) and reads `current_k` before the next one. The rule, AIMD-like:
- lower k quickly (a quarter of it, at least 1) when the smoothed inter-token latency is over target, the
  smoothed time to first token is over its target (if set), or the waiting queue has filled to
  `queue_high` of max_waiting: so k drops while the queue grows, before admission refuses work with 429s;
- raise k slowly (by 1) only after `raise_after` calm steps in a row (latency under `headroom` of its
  target, queue at most `queue_low` full); a raise that is undone at once doubles the calm steps the next
  raise waits for (up to `max_raise_after`), so k does not oscillate around the target, until far fewer
  sequences decode than when it failed (the load went away);
- after any change wait `settle` steps, so the average reflects the new k before the next decision;
- time the engine spends idle (nothing to run) counts as calm steps (`idle`), so k recovers while no load comes.
Never below the model's min_k nor above its max_k.

`AutoKClock` is the engine's side: it turns the engine's steps (when each began and ended, which sequences
ran, whether the engine went idle) into the controller's observations, and gives "auto" sequences the
current k. Nothing here reads a clock or touches tensors: the engine passes its timestamps, tests feed
timings directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moe_serve.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from moe_serve.engine.step_costs import ema
from moe_serve.errors import ValidationError
from moe_serve.moe_policy import KSpec


@dataclass(frozen=True, slots=True)
class AutoKConfig:
    target_itl: float  # seconds
    min_k: int
    max_k: int
    max_waiting: int  # the admission limit: queue pressure is measured against it
    target_ttft: float | None = None  # seconds
    smoothing: float = 0.25  # weight of the newest observation in the moving averages
    settle: int = 6  # steps after a change before the next decision (the average forgets the old k)
    headroom: float = 0.8  # raise only while the latency is under this share of its target
    queue_high: float = 0.25  # lower k while the waiting queue is this full (share of max_waiting)
    queue_low: float = 0.05  # raise k only while the waiting queue is at most this full
    raise_after: int = 20  # calm steps in a row before k goes up by one
    max_raise_after: int = 320  # the most that failed raises can stretch raise_after to

    def __post_init__(self) -> None:
        if not 1 <= self.min_k <= self.max_k:
            raise ValidationError(f"auto k needs 1 <= min_k <= max_k, got {self.min_k}..{self.max_k}")
        if not self.target_itl > 0 or (self.target_ttft is not None and not self.target_ttft > 0):
            raise ValidationError("auto k's latency targets must be greater than 0", parameter="target_itl_ms")

    @classmethod
    def from_ms(cls, target_itl_ms: float, target_ttft_ms: float | None, **fields) -> AutoKConfig:
        ttft = target_ttft_ms / 1000 if target_ttft_ms is not None else None
        return cls(target_itl=target_itl_ms / 1000, target_ttft=ttft, **fields)


LOAD_DROP = 0.75  # fewer decoding sequences than this share of those a raise failed under: a new load


class AutoKController:
    """The current k for "auto" requests, from the steps the engine observed. Deterministic: the same
    observations give the same k."""

    def __init__(self, config: AutoKConfig) -> None:
        self.config = config
        self.current_k = config.max_k  # no evidence of load yet: the best quality
        self.itl: float | None = None  # moving average of inter-token latency (seconds)
        self.ttft: float | None = None  # moving average of time to first token (seconds)
        self.waiting = 0
        self._since_change = config.settle  # free to decide at once
        self._calm = 0
        self._raise_after = config.raise_after
        self._probing = False  # the last change was a raise, not judged yet
        self._failed_at_decoding: int | None = None  # sequences decoding when the last raise failed

    def observe(
        self, step_seconds: float | None, num_decoding: int, num_waiting: int, first_token_seconds: Sequence[float] = ()
    ) -> int:
        """One engine step: `step_seconds` is the inter-token latency the step's decoding sequences saw
        (None when it cannot be measured), `num_waiting` the sequences queued after it, and
        `first_token_seconds` the time to first token of each sequence that got its first token in it.
        Returns the k for the next step."""
        c = self.config
        if step_seconds is not None and num_decoding > 0:
            self.itl = ema(self.itl, step_seconds, c.smoothing)
        for seconds in first_token_seconds:
            self.ttft = ema(self.ttft, seconds, c.smoothing)
        if not first_token_seconds and num_waiting == 0:
            self.ttft = None  # nothing queued: a new request starts at once, its first token is not at risk
        self.waiting = num_waiting
        self._since_change += 1
        if self._since_change < c.settle:
            return self.current_k
        overloaded = self._overloaded()
        if self._probing:  # the first decision after a raise judges it
            self._probing = False
            self._raise_after = min(self._raise_after * 2, c.max_raise_after) if overloaded else c.raise_after
            self._failed_at_decoding = num_decoding if overloaded else None
        elif self._failed_at_decoding is not None and num_decoding < LOAD_DROP * self._failed_at_decoding:
            # The load that made raises fail has gone (far fewer sequences decode): raise at the usual pace.
            self._raise_after, self._failed_at_decoding = c.raise_after, None
        if overloaded:
            self._calm = 0
            self._set(max(c.min_k, self.current_k - max(1, self.current_k // 4)))
        elif self._calm_now():
            self._calm += 1
            if self._calm >= self._raise_after and self.current_k < c.max_k:
                self._calm = 0
                self._probing = True
                self._set(self.current_k + 1)
        else:
            self._calm = 0
        return self.current_k

    def idle(self, seconds: float) -> int:
        """The engine had nothing to run for `seconds` (the load went away): that time counts as calm steps,
        as many as steps of the last measured latency would have filled, and what was learnt under the old
        load (averages, failed raises) is dropped. Returns the k for the next step."""
        c = self.config
        step = self.itl or c.target_itl
        self.itl = self.ttft = None
        self.waiting = 0
        self._raise_after, self._failed_at_decoding, self._probing = c.raise_after, None, False
        calm = self._calm + int(seconds / step)
        raises, self._calm = divmod(calm, c.raise_after + c.settle)
        if raises:
            self.current_k = min(c.max_k, self.current_k + raises)
        self._since_change = c.settle
        return self.current_k

    def _overloaded(self) -> bool:
        c = self.config
        return (
            (self.itl is not None and self.itl > c.target_itl)
            or (c.target_ttft is not None and self.ttft is not None and self.ttft > c.target_ttft)
            or self.waiting >= c.queue_high * c.max_waiting
        )

    def _calm_now(self) -> bool:
        c = self.config
        return (
            (self.itl is None or self.itl <= c.headroom * c.target_itl)
            and (c.target_ttft is None or self.ttft is None or self.ttft <= c.headroom * c.target_ttft)
            and self.waiting <= c.queue_low * c.max_waiting
        )

    def _set(self, k: int) -> None:
        if k != self.current_k:
            self.current_k = k
            self._since_change = 0


class AutoKClock:
    """Feeds a controller from the engine's steps: `begin_step` before a step runs, `end_step` after it."""

    def __init__(self, controller: AutoKController) -> None:
        self.controller = controller
        self._last_step_end: float | None = None  # when the previous step ended (the inter-token latency seen)
        self._idle_since: float | None = None  # when a step last left nothing to run (k recovers while idle)

    def begin_step(self, started: float, scheduled: list[ScheduledSequence]) -> None:
        """The time idle since the last step counts as calm; "auto" sequences run this step at the current k."""
        if self._idle_since is not None:
            self.controller.idle(started - self._idle_since)
            self._idle_since = self._last_step_end = None
        for item in scheduled:
            if item.seq.k_spec.auto:
                item.k_spec = KSpec.auto_at(self.controller.current_k)

    def end_step(
        self,
        output: SchedulerOutput,
        sample_items: list[int],
        sampled: float,
        ended: float,
        num_waiting: int,
        idle: bool,
    ) -> None:
        """Report a step that sampled `sample_items` at time `sampled` and ended at `ended`, leaving `num_waiting`
        sequences queued and, when `idle`, nothing to run.

        The inter-token latency of the step's decoding sequences is the time since the previous step ended
        (the engine steps back to back while anything runs, so that is when they got their previous token):
        work between steps included, as clients see it. A step that only prefills has no inter-token
        latency; prefill chunks in a decoding step count: they delay those tokens (the scheduler bounds by
        how much: max_join_stall), and k changes their cost too."""
        previous, self._last_step_end = self._last_step_end, ended
        first_tokens = []
        if self.controller.config.target_ttft is not None:
            for i in sample_items:
                seq = output.scheduled[i].seq
                if len(seq.token_times) == 1 and seq.token_times[0] == sampled:  # its first token came now
                    first_tokens.append(seq.token_times[0] - seq.arrival_time)
        itl = ended - previous if previous is not None and output.num_decodes else None
        self.controller.observe(itl, output.num_decodes, num_waiting, first_tokens)
        if idle:
            self._idle_since = ended
