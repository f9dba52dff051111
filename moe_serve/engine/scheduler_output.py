"""What the scheduler hands the runner for one step (vLLM's sched/output.py): each scheduled sequence with
its chunk and the k the step runs it at, and the sequences preempted to make room. A leaf of the engine: the
scheduler builds these, and the runners, the cost model and auto k read them, without importing the
scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_serve.engine.sequence import Sequence
from moe_serve.moe_policy import KSpec


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    start: int  # first token of this step's chunk (= tokens already computed)
    num_tokens: int  # tokens computed this step
    # Fixed when scheduled: after the step the sequence has grown, and the step's costs are observed then.
    is_decode: bool = field(init=False)
    # The k this step runs it at: the request's (Sequence.k_spec, which never changes), or for "auto" the one
    # k the engine chose for the step (engine.auto_k sets KSpec.auto_at(k) before the step runs).
    k_spec: KSpec = field(init=False)

    def __post_init__(self) -> None:
        self.is_decode = self.start == self.seq.num_tokens - 1 and self.seq.num_output_tokens > 0
        self.k_spec = self.seq.k_spec

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
