"""AutoKClock, the engine's side of auto k, fed timestamps directly: "auto" sequences run at the current k,
the inter-token latency is the time between step ends, and idle time reaches the controller once."""

from __future__ import annotations

from moe_serve.engine.auto_k import AutoKClock, AutoKConfig, AutoKController
from moe_serve.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from moe_serve.engine.sequence import Sequence
from moe_serve.moe_policy import KSpec


def decoding(k: KSpec) -> ScheduledSequence:
    seq = Sequence("r", 0, [1, 2, 3], 2, k)  # one generated token: its next step decodes
    return ScheduledSequence(seq, 2, 1)


def test_auto_sequences_run_at_the_current_k_and_fixed_ones_keep_theirs() -> None:
    clock = AutoKClock(AutoKController(AutoKConfig(target_itl=0.05, min_k=1, max_k=8, max_waiting=100)))
    auto, fixed = decoding(KSpec.auto_at(1)), decoding(KSpec(2))
    clock.controller.current_k = 5
    clock.begin_step(0.0, [auto, fixed])
    assert auto.k_spec == KSpec.auto_at(5) and fixed.k_spec == KSpec(2)  # the step's k, in its scheduled item
    assert auto.seq.k_spec == KSpec.auto_at(1)  # the sequence keeps the request's k


def test_latency_between_step_ends_and_idle_time_reach_the_controller() -> None:
    observed, idled = [], []
    controller = AutoKController(AutoKConfig(target_itl=0.05, min_k=1, max_k=8, max_waiting=100))
    controller.observe = lambda itl, decoding, waiting, first: observed.append(itl) or 8
    controller.idle = lambda seconds: idled.append(seconds) or 8
    clock = AutoKClock(controller)
    step = SchedulerOutput([decoding(KSpec.auto_at(8))])
    clock.end_step(step, [], 0.5, 1.0, num_waiting=0, idle=False)
    clock.end_step(step, [], 1.2, 1.25, num_waiting=0, idle=True)
    clock.begin_step(4.25, step.scheduled)
    clock.begin_step(4.5, step.scheduled)  # the idle time counts once
    clock.end_step(step, [], 4.6, 4.75, num_waiting=0, idle=False)
    assert observed == [None, 0.25, None] and idled == [3.0]  # no latency across the idle gap
