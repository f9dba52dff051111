"""Expert-load accounting: tokens routed to each expert per MoE layer, cumulative since the engine
started, with bounded per-layer summaries (normalised entropy, largest share). The runner counts per step
(the torch model's MoE blocks, or an ONNX graph's expert_counts output); this is the one place that
accumulates and summarises, for metrics and the dashboard alike."""

from __future__ import annotations

import math
import threading

from moe_serve.engine.runner import Runner


class ExpertLoad:
    def __init__(self, runner: Runner) -> None:
        self._runner = runner
        self._lock = threading.Lock()
        self._totals: dict[int, list[int]] = {}
        runner.track_expert_load()

    def collect(self) -> None:
        """Add what the runner counted since the last call (engine thread, after a step)."""
        deltas = self._runner.read_expert_load()
        with self._lock:
            for layer, counts in deltas.items():
                total = self._totals.setdefault(layer, [0] * len(counts))
                for expert, count in enumerate(counts):
                    total[expert] += count

    def totals(self) -> dict[int, list[int]]:
        """layer -> tokens routed to each expert so far (a copy; safe from any thread)."""
        with self._lock:
            return {layer: list(counts) for layer, counts in self._totals.items()}


def normalised_entropy(counts: list[int]) -> float:
    """1 for a uniform load over all experts, 0 when one expert takes everything."""
    mass = sum(counts)
    if len(counts) < 2 or not mass:
        return 1.0
    return -sum(c / mass * math.log(c / mass) for c in counts if c) / math.log(len(counts))


def max_share(counts: list[int]) -> float:
    mass = sum(counts)
    return max(counts) / mass if mass else 0.0
