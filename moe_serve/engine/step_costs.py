"""The scheduler's cost model (StepCosts): what a decode step and a prefill chunk cost, fitted online from
measured steps, so that a prompt joining running decodes is chunked to bound their stall (the scheduler's
`max_join_stall`). Also the moving average (`ema`) it and auto k smooth their timings with. Nothing here
reads a clock: the engine reports each step's seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from moe_serve.engine.scheduler_output import SchedulerOutput

# Chunks aim this far under the stall bound: a chunk's cost is an estimate, and the bound is a promise about
# the longest step. On the 2-vCPU development VM a plain decode step alone runs 1.2-1.5x its median at the
# 90th-99th percentile, so the estimate needs that much room: at 0.7 a 512-token prompt joining 16 tiny
# decodes measured 2.5-3.5 decode steps, repetition to repetition, against the bound of 3.
ROOM_MARGIN = 0.6


# A prefill-only step of at most this many tokens (a short request's prompt) measures the step's own
# overhead, not its tokens: it updates step_overhead and leaves the per-token rates alone.
TINY_PREFILL = 16


class StepCosts:
    """What steps cost, from measured steps. A decode-only step: measured online. A prefill chunk of n
    tokens starting at position s: n * per_token + n * (s + n / 2) * per_pair, the second term its attention
    (each token reads s + its index keys). A step that only prefills also pays `step_overhead`, what any
    step costs whatever its tokens (the runner's host work, the LM head, sampling; beside decodes it is part
    of decode_step already). A per-token average alone would let a long prompt's first chunk stall the decodes:
    its tokens cost more than the short prompts' the average was learned from; and without the overhead, a few
    tiny prefills (a 4-token completion's) teach a per-token rate several times too high, and every chunk
    after them shrinks to a sliver.

    The overhead is measured at start-up (a one-token prompt) and by every tiny prefill-only step after it (an
    average). The two rates are fitted online, by least squares over the other measured prefill steps (their
    seconds less the overhead) with older steps forgotten (weight FORGET per step), starting from the shape
    `calibrate` measured at start-up. The start-up shape alone is not enough: it times cache-free prompts from
    position 0, while a joining prompt's later chunks attend over the paged cache, which costs more per key
    (tiny benchmark model: calibrated per_pair / per_token ~0.0003, measured ~0.001, and the last chunks of a
    512-token prompt ran 10-20% over their estimate)."""

    FORGET = 0.8  # an observation's weight after each newer one (the EMA weight of a new one: 0.2)
    ANCHOR = 0.01  # pull towards the current rates, relative to the data's own weight

    def __init__(self) -> None:
        self.decode_step: float | None = None  # seconds per step that only decodes
        self.per_token: float | None = None  # seconds per prefilled token, at context 0
        self.pair_ratio = 0.0  # per_pair / per_token
        self.step_overhead = 0.0  # seconds a prefill-only step costs besides its tokens
        # Forgetting sums of the normal equations of seconds ~ per_token * tokens + per_pair * pairs:
        # tokens^2, tokens * pairs, pairs^2, tokens * seconds, pairs * seconds.
        self._sums = [0.0] * 5

    def calibrate(self, seconds_for: Callable[[int], float], short: int, long: int) -> None:
        """The shape from three timed prompts from position 0: one token (the step's own cost, less that one
        token at the short prompt's rate), then `short` and `long` tokens (the per-token and attention rates)."""
        if long <= short:
            return
        one, at_short, at_long = seconds_for(1), seconds_for(short), seconds_for(long)
        overhead = max(one - (at_short - one) / max(short - 1, 1), 0.0)
        if at_short - overhead <= 0.0:  # noise beyond what the one-token prompt can say: no overhead
            overhead = 0.0
        per_short, per_long = (at_short - overhead) / short, (at_long - overhead) / long
        per_pair = max(2.0 * (per_long - per_short) / (long - short), 0.0)
        self.per_token = max(per_short - per_pair * short / 2, per_short / 2)
        self.pair_ratio = per_pair / self.per_token
        self.step_overhead = overhead

    def chunk_seconds(self, n: int, start: int) -> float:
        """What a chunk adds to a step (the step's own overhead not included)."""
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
        chunks = [(s.num_tokens, s.start) for s in output.scheduled if not s.is_decode]
        tokens, pairs = sum(n for n, _ in chunks), sum(n * (start + n / 2) for n, start in chunks)
        if not decodes and prefill <= TINY_PREFILL and self.per_token is not None:
            # A short request's prompt alone: its seconds are mostly the step's own.
            token_seconds = tokens * self.per_token + pairs * self.per_token * self.pair_ratio
            self.step_overhead = ema(self.step_overhead, max(seconds - token_seconds, 0.0))
            return
        base = (self.decode_step or 0.0) if decodes else self.step_overhead
        self._fit(tokens, pairs, max(seconds - base, 0.0))

    def _fit(self, tokens: float, pairs: float, seconds: float) -> None:
        """Add one step to the forgetting least-squares fit and re-solve for both rates."""
        terms = (tokens * tokens, tokens * pairs, pairs * pairs, tokens * seconds, pairs * seconds)
        self._sums = [self.FORGET * old + new for old, new in zip(self._sums, terms, strict=True)]
        if self.per_token is None:  # no calibration (stateful routers): the first step gives the level
            self.per_token = max(seconds / tokens, 1e-12)
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
