"""Pipeline parallelism's batch queue, engine side: with pipeline_parallel_size = 2 the engine keeps two batches in
flight, each scheduled from requests with nothing in flight (no placeholder for a pending token), under chunked
prefill, EOS, aborts and preemptions. The fake last stage (StagedRunner) fails on a request in two batches at once
or on an input token it does not know; every finished request must carry the tokens of the runner's fixed token
function (`LaggedRunner.expected_tokens`), computed without the engine."""

from __future__ import annotations

import random

import pytest
from lagged_runner import LaggedRunner, WordTokenizer

from kestrel.config import CacheConfig, EngineConfig, SchedulerConfig
from kestrel.engine.contracts import ModelRunnerOutput, SchedulerOutput
from kestrel.engine.core import EngineCore
from kestrel.engine.scheduler import Scheduler
from kestrel.request import Request
from kestrel.sampling_params import SamplingParams
from kestrel.tiny import default_model_path

VOCAB = 500
EOS = 2
MAX_SEQS = 8


class StagedRunner(LaggedRunner):
    """A pipeline's last stage as the engine sees it: up to `depth` batches in flight, none sharing a request, and
    every input token known when its batch is launched."""

    depth: int = 2
    busy: set[str]
    peak_in_flight: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.busy = set()

    def launch(self, out: SchedulerOutput):
        assert self.in_flight < self.depth, f"a batch was launched with {self.in_flight} in flight"
        ids = set(out.num_scheduled_tokens)
        assert not ids & self.busy, f"{sorted(ids & self.busy)} scheduled while in flight"
        released = out.finished_req_ids | out.preempted_req_ids
        sent = {cached.req_id: cached for cached in out.cached_requests}
        new = {n.req_id for n in out.new_requests}
        for rid, count in out.num_scheduled_tokens.items():
            if rid in new:
                continue
            state = self.state[rid]  # known to the runner: its record (if any) or its own count
            assert rid not in released and state.pending == 0
            computed = sent[rid].num_computed_tokens if rid in sent else state.computed
            assert computed + count <= len(state.tokens), f"{rid}: an input token is not known yet"
        launched = super().launch(out)
        if out.num_scheduled_tokens:
            self.busy |= ids
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return launched

    def collect(self, launched) -> ModelRunnerOutput:
        self.busy -= set(launched.req_ids)
        return super().collect(launched)


def make_engine(pp: int, **overrides) -> tuple[EngineCore, StagedRunner]:
    args = dict(max_model_len=256, max_num_seqs=MAX_SEQS, max_num_batched_tokens=48, kv_cache_blocks=40,
                device="cpu", generation_config="vllm", pipeline_parallel_size=pp)
    config = EngineConfig.from_kwargs(str(default_model_path()), **{**args, **overrides})
    runner = StagedRunner(MAX_SEQS, VOCAB, EOS, block_size=config.cache.block_size, eos_rate=0.05)
    return EngineCore(config, runner, config.cache.num_blocks, WordTokenizer(EOS), EOS), runner


@pytest.mark.parametrize("seed", [1, 2])
def test_two_batches_in_flight_lose_nothing(seed: int) -> None:
    rng = random.Random(seed)
    engine, runner = make_engine(pp=2)
    expected: dict[str, list[int]] = {}
    aborted: set[str] = set()
    done: dict[str, list[int]] = {}
    for step in range(3000):
        if step < 300 and rng.random() < 0.5:
            rid = f"r{step}"
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 100))]
            max_tokens = rng.randrange(1, 30)
            engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens))
            expected[rid] = runner.expected_tokens(prompt, max_tokens)
            if rng.random() < 0.05:
                engine.abort_request([rid])
                aborted.add(rid)
        if step >= 300 and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert not engine.has_unfinished_requests()
    assert done == {rid: tokens for rid, tokens in expected.items() if rid not in aborted}
    stats = engine.scheduler.stats
    assert stats.num_preemptions > 0 and stats.max_batches_in_flight == 2 and runner.peak_in_flight == 2
    assert runner.in_flight == 0 and not runner.state and runner.rows_in_use == 0
    assert engine.scheduler.kv.pool.num_free_blocks == engine.scheduler.kv.pool.num_blocks


def test_one_stage_keeps_one_step_at_a_time() -> None:
    config = EngineConfig.from_kwargs(str(default_model_path()), max_model_len=256, max_num_seqs=MAX_SEQS,
                                      kv_cache_blocks=40, device="cpu", async_scheduling=True)
    runner = LaggedRunner(MAX_SEQS, VOCAB, EOS, block_size=config.cache.block_size)  # fails on a third step
    engine = EngineCore(config, runner, 40, WordTokenizer(EOS), EOS)
    for i in range(6):
        engine.add_request(f"r{i}", [3 + i] * 20, SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.stats.max_batches_in_flight == 0 and runner.steps > 0


def test_async_scheduling_off_runs_pipeline_steps_one_at_a_time() -> None:
    engine, runner = make_engine(pp=2, async_scheduling=False)
    for i in range(4):
        engine.add_request(f"r{i}", [5 + i] * 10, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.stats.max_batches_in_flight == 0 and runner.peak_in_flight == 1


def test_scheduler_leaves_out_requests_in_flight() -> None:
    """Running requests in `exclude` get no tokens (not even a placeholder); a waiting one in it holds back the
    waiting queue behind it, so admission keeps its order."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=8), CacheConfig(), 64, 512)
    for rid, n in (("a", 10), ("b", 12)):
        sched.add_request(Request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=5)))
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 10, "b": 12}
    sched.add_request(Request("c", [7] * 8, SamplingParams(max_tokens=5)))
    second = sched.schedule(exclude={"a"})
    assert second.num_scheduled_tokens == {"b": 1, "c": 8}  # b decodes on a placeholder; a is left out
    assert sched.requests["a"].num_computed_tokens == 10
    assert sched.schedule(exclude={"a", "b", "c"}).is_empty
    sched.add_request(Request("d", [9] * 4, SamplingParams(max_tokens=5)))
    sched.add_request(Request("e", [9] * 4, SamplingParams(max_tokens=5)))
    held = sched.schedule(exclude={"a", "b", "c", "d"})
    assert held.num_scheduled_tokens == {} and [r.request_id for r in sched.waiting] == ["d", "e"]
    assert sched.schedule(exclude={"a", "b", "c"}).num_scheduled_tokens == {"d": 4, "e": 4}


@pytest.mark.parametrize("pp", [1, 2])
def test_an_id_reused_after_an_abort_in_flight_gets_only_its_own_tokens(pp: int) -> None:
    """A request aborted while its step is in flight frees its id at once; the step's token for it must not land
    on a new request with that id (pp = 1: async scheduling's one step in flight; pp = 2: the batch queue)."""
    if pp == 1:
        config = EngineConfig.from_kwargs(str(default_model_path()), max_model_len=256, max_num_seqs=MAX_SEQS,
                                          kv_cache_blocks=40, device="cpu", async_scheduling=True,
                                          generation_config="vllm")
        runner = LaggedRunner(MAX_SEQS, VOCAB, EOS, block_size=config.cache.block_size)
        engine = EngineCore(config, runner, 40, WordTokenizer(EOS), EOS)
    else:
        engine, runner = make_engine(pp=2)
    runner.eos_rate = 0.0
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request("a", [5] * 10, params)
    engine.add_request("b", [6] * 10, params)
    engine.step()  # a's first step is in flight
    engine.abort_request(["a"])
    engine.add_request("a", [7] * 30, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done["a"] == runner.expected_tokens([7] * 30, 3, ignore_eos=True)
    assert done["b"] == runner.expected_tokens([6] * 10, 3, ignore_eos=True)
