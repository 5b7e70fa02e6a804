"""The scheduler's step time target (`step_time_target_ms`): the fitted step cost against an exact linear cost, the
budget it sets for steps with decodes, decodes never starved by a prefill ahead of them, prompts still finishing,
and the same tokens as without it. Steps are timed on a fake clock that the fake runner advances by a known cost."""

from __future__ import annotations

import pytest
from test_scheduler import FakeRunner

from kestrel.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from kestrel.engine.contracts import run_step
from kestrel.engine.scheduler import MIN_PREFILL_CHUNK, Scheduler
from kestrel.engine.step_cost import StepCostModel
from kestrel.request import Request
from kestrel.sampling_params import SamplingParams
from kestrel.tiny import default_model_path

FIXED_S, PER_TOKEN_S = 0.004, 0.0001  # the fake device: 4 ms a step and 0.1 ms a token


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_fit_recovers_a_linear_cost_and_forgets_old_steps() -> None:
    model = StepCostModel(window=4)
    assert model.fit() is None
    for tokens in (32, 32, 32):
        model.observe(tokens, FIXED_S + PER_TOKEN_S * tokens)
    # One size: no slope to see; all of the time taken as per-token (an overestimate, so the next budget is smaller)
    assert model.fit() == (0.0, pytest.approx((FIXED_S + PER_TOKEN_S * 32) / 32))
    for tokens in (100, 500, 900, 1300):
        model.observe(tokens, FIXED_S + PER_TOKEN_S * tokens)
    fixed, per_token = model.fit()
    assert fixed == pytest.approx(FIXED_S) and per_token == pytest.approx(PER_TOKEN_S)
    assert model.num_observations == 4
    assert model.tokens_within(0.024) in (199, 200)  # (24 - 4) ms / 0.1 ms
    assert model.tokens_within(0.002) == 0
    model.observe(0, 1.0)  # an empty step and a non-positive time are not steps
    model.observe(10, 0.0)
    assert model.num_observations == 4
    for tokens in (40, 30, 20, 10):  # times that fall with the tokens (noise): all of the time taken as per-token
        model.observe(tokens, 0.01 + (40 - tokens) * 1e-4)
    fixed, per_token = model.fit()
    assert fixed == 0.0 and per_token == pytest.approx((0.010 + 0.011 + 0.012 + 0.013) / 100)


def _scheduler(target_ms: float | None, clock: Clock, budget: int = 2048, max_seqs: int = 16,
               policy: str = "fcfs") -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                     step_time_target_ms=target_ms, policy=policy),
                     CacheConfig(enable_prefix_caching=False), 1024, 4096, clock=clock)


def _run(sched: Scheduler, clock: Clock, add: dict[int, list[Request]], max_steps: int = 2000):
    """Steps until every request finished, adding `add[step]` before that step; returns per step the scheduled
    tokens by request id, and every finished request's output tokens."""
    runner = FakeRunner()
    steps: list[dict[str, int]] = []
    outputs: dict[str, list[int]] = {}
    for step in range(max_steps):
        for request in add.get(step, []):
            sched.add_request(request)
        if not sched.has_unfinished_requests() and step > max(add):
            break
        out = sched.schedule()
        steps.append(dict(out.num_scheduled_tokens))
        clock.now += FIXED_S + PER_TOKEN_S * out.total_num_scheduled_tokens
        for request in sched.update(out, run_step(runner, out)):
            if request.is_finished:
                outputs[request.request_id] = list(request.output_token_ids)
    return steps, outputs


def _requests(prefix: str, count: int, prompt: int, max_tokens: int) -> list[Request]:
    return [Request(f"{prefix}{i}", list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens))
            for i in range(count)]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_steps_with_decodes_stay_within_the_target_and_decodes_are_never_starved(policy: str) -> None:
    target_ms = 20.0  # (20 - 4) / 0.1 = 160 tokens a step
    clock = Clock()
    sched = _scheduler(target_ms, clock, policy=policy)
    # Eight requests decode; then long prompts arrive (under the priority policy ahead of the decodes in the
    # running batch, so a running prefill comes before them in every step).
    decoders = _requests("d", 8, 16, 200)
    prompts = _requests("p", 8, 1500, 4)
    if policy == "priority":
        for request in prompts:
            request.priority = -1
    steps, outputs = _run(sched, clock, {0: decoders, 30: prompts})
    assert set(outputs) == {r.request_id for r in decoders + prompts}  # every prompt finished
    allowed = int((target_ms / 1e3 - FIXED_S) / PER_TOKEN_S)
    over, prefill_steps = 0, 0
    for step in steps[30:]:
        decoding = [rid for rid in step if rid.startswith("d")]
        assert all(step[rid] == 1 for rid in decoding)
        if len(decoding) == 8 and any(rid.startswith("p") for rid in step):
            prefill_steps += 1
            over += sum(step.values()) > max(allowed + 1, 8 + MIN_PREFILL_CHUNK)
    # Only steps with a prefill chunk are fitted: the first one, untimed, took the whole budget; the second was cut
    # by the first's time taken as all per-token; every later one kept to the target by the fitted line.
    assert over <= 2 and prefill_steps >= 10
    # Every decoder got a token in every step while it ran (none waited behind a prompt's chunk).
    for request in decoders:
        ran = [i for i, step in enumerate(steps) if request.request_id in step]
        assert ran == list(range(ran[0], ran[-1] + 1))


def test_without_decodes_a_prompt_takes_the_full_budget_and_the_tokens_are_those_without_a_target() -> None:
    results = {}
    for target_ms in (None, 12.0):
        clock = Clock()
        sched = _scheduler(target_ms, clock, budget=1024)
        steps, outputs = _run(sched, clock, {0: _requests("a", 1, 3000, 8), 5: _requests("b", 4, 600, 40),
                                             60: _requests("c", 2, 40, 8)})
        results[target_ms] = outputs
        if target_ms is None:
            assert sched.step_cost is None
            continue
        assert [sum(s.values()) for s in steps[:2]] == [1024, 1024]  # alone: no decodes to keep a pace for
        assert any(0 < sum(s.values()) < 1024 for s in steps[10:])  # with decodes: cut to the target
    assert results[None] == results[12.0]


def test_an_idle_engine_does_not_time_its_wait_for_requests() -> None:
    clock = Clock()
    sched = _scheduler(50.0, clock, budget=64)  # prompts of 100 tokens go in two steps
    _run(sched, clock, {0: _requests("a", 2, 100, 4)})
    seen = sched.step_cost.num_observations
    assert seen > 0 and sched._last_step_done is None
    clock.now += 60.0  # a minute without requests
    _run(sched, clock, {0: _requests("b", 1, 100, 2)})
    assert sched.step_cost.num_observations == seen + 1  # the first step after the wait is not timed
    assert max(s for _, s in sched.step_cost._steps) < 1.0


@pytest.mark.parametrize("value", [0, -5, float("nan"), float("inf"), True, "30"])
def test_a_bad_target_is_refused_by_name(value) -> None:
    with pytest.raises(ConfigError, match="step_time_target_ms"):
        EngineConfig.from_kwargs(str(default_model_path()), step_time_target_ms=value)


def test_the_target_is_a_cli_flag() -> None:
    from kestrel.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", str(default_model_path()), "--step-time-target-ms", "25"])
    assert args.step_time_target_ms == 25.0


def test_the_tiny_model_gives_the_same_tokens_under_a_target() -> None:
    """Greedy generation of kestrel-tiny (prompts of several lengths, chunked, with decodes running) is the same
    under a tight target, which cuts the prefill chunks, as without one."""
    import random

    from kestrel import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 8000) for _ in range(length)]}
               for length in (12, 300, 20, 200, 9, 350)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tokens, steps = {}, {}
    for target in (None, 1.0):
        llm = LLM(str(default_model_path()), step_time_target_ms=target, max_num_seqs=4, max_num_batched_tokens=256)
        tokens[target] = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        scheduler = llm.engine.scheduler
        steps[target] = scheduler.stats.num_steps
        if target is not None:
            assert scheduler.step_cost.num_observations > 0
            fitted = scheduler.step_cost.fit()
            assert fitted is None or fitted[1] > 0
    assert tokens[None] == tokens[1.0]
    assert steps[1.0] > steps[None]  # the prompts went in smaller chunks beside the decodes


@pytest.mark.parametrize("other, reason", [({"enable_chunked_prefill": False}, "chunked prefill is off"),
                                           ({"pipeline_parallel_size": 2}, "pipeline_parallel_size")])
def test_a_target_is_refused_where_it_cannot_mean_what_it_says(other, reason) -> None:
    with pytest.raises(ConfigError, match=f"step_time_target_ms.*{reason}"):
        EngineConfig.from_kwargs(str(default_model_path()), step_time_target_ms=30.0, **other)
