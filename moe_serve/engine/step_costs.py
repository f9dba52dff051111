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


# A prefill-only step of at most this many tokens near the start of their prompts (a short request's prompt)
# measures the step's own overhead, not its tokens: it updates step_overhead and leaves the per-token rates alone.
TINY_PREFILL = 16


class StepCosts:
    """What steps cost, from measured steps. A decode-only step: measured online. A prefill chunk of n
    tokens starting at position s: n * per_token + n * (s + n / 2) * per_pair + s * per_context, the second
    term its attention (each token reads s + its index keys), the third its cached context's first read (a
    chunk deep in a prompt brings its s cached keys in from memory once, whatever its tokens: on the demo model
    one token at 3,000 cached keys costs about 6 ms, each further token about 0.5 ms). A step that only prefills
    also pays `step_overhead`, what any step costs whatever its tokens (the runner's host work, the LM head,
    sampling; beside decodes it is part of decode_step already). A per-token average alone would let a long
    prompt's first chunk stall the decodes: its tokens cost more than the short prompts' the average was learned
    from; and without the overhead, a few tiny prefills (a 4-token completion's) teach a per-token rate several
    times too high, and every chunk after them shrinks to a sliver.

    The overhead is measured at start-up (a one-token prompt) and by every tiny prefill-only step after it (an
    average). The rates are fitted online, by least squares over the other measured prefill steps (their
    seconds less the overhead) with older steps forgotten (weight FORGET per step), starting from the shape
    `calibrate` measured at start-up. The start-up shape alone is not enough: it times cache-free prompts from
    position 0, while a joining prompt's later chunks attend over the paged cache, which costs more per key
    (tiny benchmark model: calibrated per_pair / per_token ~0.0003, measured ~0.001, and the last chunks of a
    512-token prompt ran 10-20% over their estimate), and it cannot see the context term at all."""

    FORGET = 0.8  # an observation's weight after each newer one (the EMA weight of a new one: 0.2)
    ANCHOR = 0.01  # pull towards the current rates, relative to the data's own weight

    def __init__(self) -> None:
        self.decode_step: float | None = None  # seconds per step that only decodes
        self.per_token: float | None = None  # seconds per prefilled token, at context 0
        self.pair_ratio = 0.0  # per_pair / per_token
        self.context_ratio = 0.0  # per_context / per_token
        self.step_overhead = 0.0  # seconds a prefill-only step costs besides its tokens
        self._start_rates: tuple[float, float] | None = None  # (per_token, pair_ratio) as calibrated
        # Forgetting sums of the normal equations of seconds ~ rates . (tokens, pairs, context): their Gram
        # matrix and right-hand side.
        self._gram = [[0.0] * 3 for _ in range(3)]
        self._rhs = [0.0] * 3

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
        self._start_rates = (self.per_token, self.pair_ratio)

    def chunk_seconds(self, n: int, start: int) -> float:
        """What a chunk adds to a step (the step's own overhead not included)."""
        assert self.per_token is not None
        return self.per_token * (n * (1.0 + self.pair_ratio * (start + n / 2)) + self.context_ratio * start)

    def start_chunk_seconds(self, n: int) -> float:
        """What n tokens from position 0 cost by the start-up calibration, which timed exactly such prompts (the
        current rates where there was none). The refitted rates fit the recent chunks at their depth; deep in a
        long prompt every chunk sits at about the same context, so the fit may put attention's cost on the
        per-token rate, and its extrapolation to position 0 is then several times too high (a 16 x 4,000-token
        score: 111 tokens at position 1,816 fit a bound meant for 128 tokens at 0, steps of 50-60 ms)."""
        assert self.per_token is not None
        per_token, pair_ratio = self._start_rates or (self.per_token, self.pair_ratio)
        return n * per_token * (1.0 + pair_ratio * n / 2)

    def tokens_within(self, seconds: float, start: int) -> int:
        """The most prefill tokens from position `start` that cost at most `seconds` (0 where even the cached
        context's read does not fit)."""
        assert self.per_token is not None
        seconds -= self.per_token * self.context_ratio * start
        if seconds <= 0.0:
            return 0
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
        context = sum(start for _, start in chunks)
        if not decodes and prefill <= TINY_PREFILL and self.per_token is not None and pairs <= TINY_PREFILL**2:
            # A short request's prompt alone: its seconds are mostly the step's own. (Not a few tokens deep in a
            # long prompt: each reads thousands of cached keys, and taken for overhead they taught every step
            # to cost milliseconds more than it does.)
            token_seconds = sum(self.chunk_seconds(n, start) for n, start in chunks)
            self.step_overhead = ema(self.step_overhead, max(seconds - token_seconds, 0.0))
            return
        base = (self.decode_step or 0.0) if decodes else self.step_overhead
        self._fit((tokens, pairs, context), max(seconds - base, 0.0))

    def _fit(self, terms: tuple[float, float, float], seconds: float) -> None:
        """Add one step to the forgetting least-squares fit and re-solve for the rates."""
        for i in range(3):
            self._rhs[i] = self.FORGET * self._rhs[i] + terms[i] * seconds
            for j in range(3):
                self._gram[i][j] = self.FORGET * self._gram[i][j] + terms[i] * terms[j]
        if self.per_token is None:  # no calibration (stateful routers): the first step gives the level
            self.per_token = max(seconds / terms[0], 1e-12)
        current = (self.per_token, self.per_token * self.pair_ratio, self.per_token * self.context_ratio)
        # (G + a D) rates = rhs + a D current, D = diag(G): where the steps so far do not tell the rates apart
        # (every chunk at the same context), they stay near the current ones instead of swinging along the
        # line the data leave open. A rate that fits negative (attention never makes tokens cheaper) is
        # dropped and the others refitted without it.
        active = [i for i in range(3) if self._gram[i][i] > 0.0]  # (no chunk deep in a prompt yet: no context)
        while True:
            anchor = [self.ANCHOR * self._gram[i][i] for i in active]
            matrix = [[self._gram[i][j] + (anchor[a] if i == j else 0.0) for j in active] for a, i in enumerate(active)]
            rhs = [self._rhs[i] + anchor[a] * current[i] for a, i in enumerate(active)]
            solved = _solve(matrix, rhs)
            if solved is None:  # the steps cannot tell these terms apart yet: keep the current rates
                return
            rates = dict(zip(active, solved, strict=True))
            negative = [i for i in active if i != 0 and rates[i] < 0.0]
            if not negative:
                break
            active = [i for i in active if i not in negative]
        per_token = rates[0]
        if per_token <= 0.0:  # noise in tiny steps: keep the last positive rates
            return
        self.per_token = per_token
        self.pair_ratio = rates.get(1, 0.0) / per_token
        self.context_ratio = rates.get(2, 0.0) / per_token

    def prefill_room(self, max_stall: float, num_decodes: int) -> float | None:
        """Seconds of prefill a step with decodes may spend and stay under max_stall decode steps (None:
        nothing decodes, or the costs are not known yet)."""
        if not num_decodes or self.decode_step is None or not self.per_token:
            return None
        return (max_stall - 1.0) * self.decode_step * ROOM_MARGIN


def ema(old: float | None, new: float, weight: float = 0.2) -> float:
    """Exponential moving average: `new` weighs `weight`; the first value starts it."""
    return new if old is None else (1 - weight) * old + weight * new


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """matrix x = rhs by Gaussian elimination with partial pivoting (a few unknowns); None if singular."""
    n = len(rhs)
    rows = [row[:] + [value] for row, value in zip(matrix, rhs, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) < 1e-300:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / rows[col][col]
            for c in range(col, n + 1):
                rows[r][c] -= factor * rows[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (rows[r][n] - sum(rows[r][c] * x[c] for c in range(r + 1, n))) / rows[r][r]
    return x
