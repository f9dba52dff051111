"""experts_per_token "auto": the controller on injected timings (falls under load, recovers when it goes away,
stays in range, hysteresis, queue pressure before 429s, the TTFT target), validation in the Python API, and
an engine under a synthetic load (a runner whose steps cost more per sequence and per expert) whose auto k
falls, then recovers once the load is gone."""

from __future__ import annotations

import time

import pytest

from moe_serve import LLM, SamplingParams
from moe_serve.config import EngineConfig
from moe_serve.engine.auto_k import AutoKConfig, AutoKController
from moe_serve.engine.sequence import Sequence
from moe_serve.errors import ValidationError
from moe_serve.layers.routers import router_config
from moe_serve.moe_policy import KSpec
from moe_serve.testing import create_random_artifact
from tests.conftest import NUM_EXPERTS, classifier_config, lm_config, moe_config

TARGET = 0.050  # seconds
SLOW, FAST = 0.120, 0.010  # inter-token latencies well over and well under the target


def controller(**fields) -> AutoKController:
    return AutoKController(AutoKConfig(**{"target_itl": TARGET, "min_k": 1, "max_k": 8, "max_waiting": 100} | fields))


def run(c: AutoKController, steps: int, itl: float | None, decoding: int = 8, waiting: int = 0) -> list[int]:
    return [c.observe(itl, decoding, waiting) for _ in range(steps)]


# ---- the controller ------------------------------------------------------------------------------------


def test_starts_at_the_best_quality_and_stays_there_without_load() -> None:
    c = controller()
    assert c.current_k == 8
    assert set(run(c, 200, FAST)) == {8}


def test_falls_quickly_under_load_and_recovers_slowly_when_it_goes_away() -> None:
    c = controller()
    falling = run(c, 60, SLOW)
    assert falling[0] < 8  # the first step over target already lowers k
    assert falling[-1] == 1  # never below min_k, however long the overload lasts
    assert min(falling) == 1 and falling == sorted(falling, reverse=True)
    steps_to_fall = falling.index(1) + 1
    rising = run(c, 1000, FAST)
    assert rising[-1] == 8 and max(rising) == 8  # never above max_k
    assert rising == sorted(rising)
    assert rising.index(8) + 1 > 5 * steps_to_fall  # raised slowly: one expert at a time after calm steps


def test_a_latency_between_headroom_and_target_changes_nothing() -> None:
    """Hysteresis: at 90% of the target k neither falls (not over) nor rises (no headroom)."""
    c = controller()
    run(c, 12, SLOW)
    run(c, 30, 0.9 * TARGET)  # the average forgets the overload
    k = c.current_k
    assert 1 < k < 8
    assert set(run(c, 500, 0.9 * TARGET)) == {k}


def test_a_raise_that_overshoots_makes_the_next_raise_wait_longer() -> None:
    """Latency that only meets the target below k = 4: k settles at 3 and probes 4 ever more rarely."""

    def latency(k: int) -> float:
        return FAST if k <= 3 else SLOW

    c = controller()
    ks = []
    for _ in range(3000):
        ks.append(c.observe(latency(c.current_k), 8, 0))
    probes = [i for i in range(1, len(ks)) if ks[i] > ks[i - 1] and ks[i - 1] == 3]
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert len(probes) >= 3 and gaps == sorted(gaps) and gaps[-1] > 3 * gaps[0]  # backing off
    assert sum(k == 3 for k in ks[500:]) / len(ks[500:]) > 0.9  # most of the time at the best k that holds
    # The load goes away (a quarter of the sequences decode): raises come at the usual pace again.
    rising = run(c, 200, FAST, decoding=2)
    assert rising[-1] == 8 and rising.index(8) < 5 * (c.config.raise_after + c.config.settle)


def test_the_waiting_queue_lowers_k_before_admission_refuses_work() -> None:
    c = controller(max_waiting=100)
    assert run(c, 20, FAST, waiting=10)[-1] == 8  # a short queue is fine
    falling = run(c, 60, FAST, waiting=30)  # a quarter full: lower k while there is still room
    assert falling[-1] == 1
    run(c, 1000, FAST, waiting=10)  # between queue_low and queue_high: hold
    assert c.current_k == 1
    assert run(c, 1000, FAST, waiting=0)[-1] == 8


def test_the_ttft_target_lowers_k_and_is_forgotten_when_the_queue_empties() -> None:
    c = controller(target_ttft=1.0)
    for _ in range(40):
        c.observe(FAST, 8, 5, [3.0])  # first tokens after 3 s: over the TTFT target
    assert c.current_k == 1
    run(c, 1000, FAST, waiting=0)  # the queue emptied: nothing waits for a first token any more
    assert c.current_k == 8


def test_idle_time_counts_as_calm_steps() -> None:
    c = controller()
    run(c, 60, SLOW)
    assert c.current_k == 1
    per_raise = c.config.raise_after + c.config.settle
    assert c.idle(3 * per_raise * SLOW) == 4  # as many raises as calm steps of the last latency would make
    assert c.itl is None  # the old load's average is forgotten
    assert c.idle(3600) == 8  # never above max_k
    assert run(c, 50, FAST)[-1] == 8


def test_prefill_only_steps_leave_the_latency_average_alone() -> None:
    c = controller()
    run(c, 30, SLOW)
    low = c.current_k
    run(c, 100, None, decoding=0)  # nothing decoding: no inter-token latency to judge
    assert c.itl is not None and c.itl > TARGET and c.current_k == 1 <= low


def test_deterministic() -> None:
    timings = [SLOW] * 40 + [FAST] * 300 + [0.045] * 50 + [SLOW] * 10
    first, second = controller(), controller()
    assert [first.observe(t, 4, 0) for t in timings] == [second.observe(t, 4, 0) for t in timings]


def test_config_checks() -> None:
    with pytest.raises(ValidationError):
        AutoKConfig(TARGET, 3, 2, 10)
    with pytest.raises(ValidationError):
        AutoKConfig(0.0, 1, 2, 10)
    with pytest.raises(ValidationError) as info:
        EngineConfig(target_itl_ms=0)
    assert info.value.parameter == "target_itl_ms"
    with pytest.raises(ValidationError) as info:
        EngineConfig(target_ttft_ms=500)
    assert info.value.parameter == "target_ttft_ms" and "target_itl_ms" in str(info.value)
    assert AutoKConfig.from_ms(50, 2000, min_k=1, max_k=4, max_waiting=8).target_ttft == 2.0


# ---- specs, sequences, validation ----------------------------------------------------------------------


def test_auto_blocks_are_shared_only_among_auto_sequences() -> None:
    """An "auto" sequence's cached keys may come from several k: a fixed k must never reuse them."""

    def salt(spec: KSpec) -> int:
        return Sequence("r", 0, [1, 2, 3], 3, spec).cache_salt

    assert salt(KSpec.auto_at(2)) == salt(KSpec.auto_at(3)) != salt(KSpec(2))
    assert KSpec.auto_at(2).label == "auto" and KSpec.auto_at(2).k_varies and not KSpec.auto_at(2).adaptive


LM = dict(seed=5, max_position_embeddings=512)


@pytest.fixture(scope="module")
def lm_path(tiny_model):
    """llm's artifact, for the tests that build an LLM of their own on it: one whose runner they slow down, or
    one with another target or none."""
    return tiny_model(**LM)


@pytest.fixture(scope="module")
def llm(tiny_llm) -> LLM:
    return tiny_llm(**LM, engine=EngineConfig(target_itl_ms=10_000))  # a target no test run comes near


def test_auto_needs_a_target_and_an_moe_model(lm_path, tmp_path) -> None:
    plain = LLM(lm_path)
    with pytest.raises(ValidationError, match="--target-itl-ms") as info:
        plain.generate("hi", SamplingParams(experts_per_token="auto"))
    assert info.value.parameter == "experts_per_token"
    with pytest.raises(ValidationError) as info:
        plain.score("hello there", experts_per_token="auto")
    assert info.value.parameter == "experts_per_token"
    dense = LLM(create_random_artifact(tmp_path / "dense", lm_config(moe=None)), EngineConfig(target_itl_ms=50))
    with pytest.raises(ValidationError, match="no MoE layers") as info:
        dense.generate("hi", SamplingParams(experts_per_token="auto"))
    assert info.value.parameter == "experts_per_token"


def test_auto_with_a_moe_policy_is_refused(llm: LLM) -> None:
    with pytest.raises(ValidationError, match="not both") as info:
        SamplingParams(experts_per_token="auto", moe={"policy": "top_p", "p": 0.5})
    assert info.value.parameter == "moe"
    with pytest.raises(ValidationError, match="not both") as info:
        llm.score("hello there", experts_per_token="auto", moe={"policy": "top_p", "p": 0.5})
    assert info.value.parameter == "moe"
    with pytest.raises(ValidationError) as info:
        SamplingParams(experts_per_token="fast")
    assert info.value.parameter == "experts_per_token"


def test_auto_resolves_to_the_models_range(llm: LLM) -> None:
    assert llm.inputs.resolve("auto", None) == KSpec(NUM_EXPERTS, min_k=1, auto=True)


def test_auto_without_load_runs_at_max_k_and_says_so(llm: LLM) -> None:
    """No load: auto is the model's max k, token for token, and reports its mean k (not one fixed k)."""
    params = dict(max_tokens=12, temperature=0, ignore_eos=True)
    (auto,) = llm.generate("ROMEO.", SamplingParams(experts_per_token="auto", **params))
    (fixed,) = llm.generate("ROMEO.", SamplingParams(experts_per_token=NUM_EXPERTS, **params))
    assert auto.outputs[0].token_ids == fixed.outputs[0].token_ids
    assert auto.experts_per_token is None and auto.experts is not None
    assert auto.experts.mean == NUM_EXPERTS
    (score,) = llm.score("hello there", experts_per_token="auto")
    assert score.experts_per_token is None and score.experts.mean == NUM_EXPERTS


def test_classify_takes_auto(tmp_path) -> None:
    config = classifier_config(moe=moe_config(router=router_config("topk_uniform")))
    clf = LLM(create_random_artifact(tmp_path / "clf", config), EngineConfig(target_itl_ms=10_000))
    (out,) = clf.classify("Exit, pursued by a bear.", experts_per_token="auto")
    (fixed,) = clf.classify("Exit, pursued by a bear.", experts_per_token=NUM_EXPERTS)
    assert out.label == fixed.label and out.experts_per_token is None and out.experts.mean == NUM_EXPERTS


# ---- an engine under a synthetic load ------------------------------------------------------------------


class SlowRunner:
    """The real runner, then a sleep per sequence and expert of the step (seconds_per_expert x the sum of
    the step's k): a load that grows with concurrency and that lowering k relieves, as MoE compute does.
    Records the k each "auto" sequence ran with, step by step."""

    def __init__(self, runner, seconds_per_expert: float) -> None:
        self.runner = runner
        self.seconds_per_expert = seconds_per_expert
        self.auto_ks: list[int] = []  # the k "auto" ran with, one entry per step that had any

    def execute(self, output):
        result = self.runner.execute(output)
        time.sleep(self.seconds_per_expert * sum(item.k_spec.k for item in output.scheduled))
        auto = {item.k_spec.k for item in output.scheduled if item.k_spec.auto}
        assert len(auto) <= 1  # every "auto" sequence of a step runs at the step's one k
        self.auto_ks += auto
        return result

    def __getattr__(self, name: str):
        return getattr(self.runner, name)


@pytest.mark.slow
def test_engine_auto_k_falls_under_load_and_recovers_when_it_goes_away(lm_path) -> None:
    # Synthetic costs well above this shared machine's noise (single steps of 30 ms happen under load).
    llm = LLM(lm_path, EngineConfig(target_itl_ms=100, max_num_seqs=32))
    runner = llm.engine.runner = SlowRunner(llm.engine.runner, 0.002)  # 24 sequences at k=4: 192 ms a step
    auto = dict(experts_per_token="auto", temperature=0, ignore_eos=True)

    loaded = llm.generate(["ROMEO."] * 24, SamplingParams(max_tokens=50, **auto))
    under_load = list(runner.auto_ks)
    assert under_load[0] == NUM_EXPERTS and min(under_load) < NUM_EXPERTS  # started at max, fell
    means = [out.experts.mean for out in loaded]
    assert all(m < NUM_EXPERTS for m in means)  # each response reports the (lower) mean k it ran with

    runner.auto_ks.clear()  # the load is gone: one request alone, 8 ms of synthetic cost a step at k=4
    idle = []
    controller = llm.engine.auto_k
    controller.idle = lambda seconds: idle.append(seconds) or controller.current_k  # recovery by steps only
    (alone,) = llm.generate("JULIET.", SamplingParams(max_tokens=240, **auto))
    assert len(idle) == 1  # the engine had run out of work between the two calls
    assert runner.auto_ks[-1] == NUM_EXPERTS == llm.engine.auto_k.current_k  # recovered
    assert min(means) < alone.experts.mean < NUM_EXPERTS  # it started low and climbed back


def test_fixed_k_requests_are_untouched_by_auto_k(lm_path) -> None:
    llm = LLM(lm_path, EngineConfig(target_itl_ms=1))  # a target nothing meets: auto k sinks to min
    runner = llm.engine.runner = SlowRunner(llm.engine.runner, 0.0005)
    params = dict(max_tokens=40, temperature=0, ignore_eos=True)
    outs = llm.generate(
        ["ROMEO.", "ROMEO."],
        [SamplingParams(experts_per_token=3, **params), SamplingParams(experts_per_token="auto", **params)],
    )
    assert outs[0].experts_per_token == 3 and outs[0].experts.mean == 3
    assert runner.auto_ks[-1] == 1 and outs[1].experts.mean < 3
    (alone,) = llm.generate("ROMEO.", SamplingParams(experts_per_token=3, **params))
    assert alone.outputs[0].token_ids == outs[0].outputs[0].token_ids  # batch invariance holds
