"""Per-sequence state: WAITING -> RUNNING -> FINISHED, token lists and counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from moe_serve.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    experts_per_token: int
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    text: str = ""
    slot: int | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0  # time.monotonic() values, for latency metrics
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def uncached_token_ids(self) -> list[int]:
        """Tokens whose keys and values are not in the cache yet: the prompt, then the last token."""
        all_ids = self.prompt_token_ids + self.output_token_ids
        return all_ids[self.num_cached_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
