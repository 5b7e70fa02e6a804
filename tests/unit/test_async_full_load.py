"""Async scheduling at full load: exactly max_num_seqs running, batches that drain and refill while prompts are
prefilled in chunks, and finishes, aborts and preemptions every step. The worker (LaggedRunner) holds exactly
max_num_seqs rows and one step in flight, as the GPU runner does; every finished request must carry the tokens
the runner's fixed token function gives, and at the end no row, block or step may be left held."""

from __future__ import annotations

import asyncio
import random

import pytest
from lagged_runner import LaggedRunner, WordTokenizer

from kestrel.config import EngineConfig
from kestrel.engine.core import EngineCore
from kestrel.entrypoints.async_engine import AsyncEngine
from kestrel.sampling_params import SamplingParams
from kestrel.tiny import default_model_path

VOCAB = 500
EOS = 2
MAX_SEQS = 16


def make_engine(*, async_scheduling: bool, num_blocks: int = 512, budget: int = 256, eos_rate: float = 0.0,
                max_model_len: int = 512) -> tuple[EngineCore, LaggedRunner]:
    config = EngineConfig.from_kwargs(str(default_model_path()), max_model_len=max_model_len,
                                      max_num_seqs=MAX_SEQS, max_num_batched_tokens=budget,
                                      kv_cache_blocks=num_blocks, async_scheduling=async_scheduling, device="cpu",
                                      generation_config="vllm")  # the runner's EOS is the only one
    runner = LaggedRunner(MAX_SEQS, VOCAB, EOS, block_size=config.cache.block_size, eos_rate=eos_rate)
    return EngineCore(config, runner, num_blocks, WordTokenizer(EOS), EOS), runner


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def assert_all_released(engine: EngineCore, runner: LaggedRunner) -> None:
    pool = engine.scheduler.kv.pool
    assert not engine.has_unfinished_requests() and not engine._batch_queue
    assert runner.rows_in_use == 0 and not runner.state and runner.in_flight == 0
    assert pool.num_free_blocks == pool.num_blocks
    assert not engine.scheduler.has_pending_releases


def run_all(engine: EngineCore, runner: LaggedRunner, max_steps: int = 100_000,
            ) -> dict[str, tuple[list[int], str | None]]:
    done: dict[str, tuple[list[int], str | None]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            assert runner.rows_in_use <= MAX_SEQS
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_batch_that_drains_then_a_burst_that_refills_the_table(async_scheduling):
    """The reported crash: a full batch finishes on its last in-flight tokens, then a burst of chunked
    prefills is admitted into rows the worker had not yet been told were free."""
    engine, runner = make_engine(async_scheduling=async_scheduling)
    rng = random.Random(0)
    for burst, (count, max_tokens) in enumerate([(MAX_SEQS, 16), (200, 64), (MAX_SEQS, 8), (40, 24)]):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        prompts = {f"b{burst}-{i}": random_prompt(rng, 100) for i in range(count)}
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, params)
        done = run_all(engine, runner)
        assert {rid: tokens for rid, (tokens, _) in done.items()} == {
            rid: runner.expected_tokens(p, max_tokens, ignore_eos=True) for rid, p in prompts.items()}
        assert runner.peak_rows == MAX_SEQS
        assert_all_released(engine, runner)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_finishes_aborts_and_preemptions_every_step_lose_nothing(seed):
    """Requests arrive every step, EOS ends them at random, aborts hit running and waiting ones, and a small
    KV cache forces preemptions; the row table stays within max_num_seqs and every request ends correctly."""
    rng = random.Random(seed)
    engine, runner = make_engine(async_scheduling=True, num_blocks=48, budget=64, eos_rate=0.04,
                                 max_model_len=256)
    expected: dict[str, list[int]] = {}
    aborted: set[str] = set()
    done: dict[str, tuple[list[int], str | None]] = {}
    live: list[str] = []
    full_steps = 0
    next_id = 0
    for step in range(1500):
        if step < 1200:
            for _ in range(rng.choice([0, 0, 1, 2, 4])):
                rid = f"r{next_id}"
                next_id += 1
                prompt = random_prompt(rng, rng.randrange(1, 90))
                max_tokens = rng.randrange(1, 40)
                engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens))
                expected[rid] = runner.expected_tokens(prompt, max_tokens)
                live.append(rid)
            if live and rng.random() < 0.3:
                victim = live.pop(rng.randrange(len(live)))
                engine.abort_request([victim])
                aborted.add(victim)
        if not engine.has_unfinished_requests():
            continue
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
                if out.request_id in live:
                    live.remove(out.request_id)
        assert runner.rows_in_use <= MAX_SEQS
        full_steps += engine.scheduler.num_running == MAX_SEQS
    done.update(run_all(engine, runner))
    for rid, (tokens, reason) in done.items():
        assert rid not in aborted
        assert tokens == expected[rid], rid
        assert reason == ("stop" if tokens[-1] == EOS else "length")
    assert set(done) | aborted == set(expected)
    assert engine.scheduler.stats.num_preemptions > 0 and full_steps > 0 and aborted
    assert_all_released(engine, runner)


def test_async_server_engine_with_more_streams_than_rows():
    """AsyncEngine over the lagged runner: 3x max_num_seqs concurrent streams, a third of them closed early,
    then a second wave after the engine went idle."""
    core, runner = make_engine(async_scheduling=True, num_blocks=256, budget=128, eos_rate=0.02)
    engine = AsyncEngine(core, WordTokenizer(EOS)).start()
    rng = random.Random(5)

    async def one(rid: str, prompt: list[int], max_tokens: int, leave_after: int | None):
        stream = engine.generate(rid, prompt, SamplingParams(max_tokens=max_tokens))
        last = None
        async for out in stream:
            last = out
            if leave_after is not None and len(out.outputs[0].token_ids) >= leave_after:
                await stream.aclose()
                return rid, None
        return rid, last.outputs[0].token_ids

    async def wave(tag: str):
        jobs = []
        for i in range(3 * MAX_SEQS):
            prompt = random_prompt(rng, rng.randrange(20, 120))
            max_tokens = rng.randrange(4, 48)
            leave = rng.randrange(1, 4) if i % 3 == 0 else None
            jobs.append((f"{tag}{i}", prompt, max_tokens, leave))
        results = await asyncio.gather(*(one(*job) for job in jobs))
        for (rid, prompt, max_tokens, _), (_, tokens) in zip(jobs, results, strict=True):
            if tokens is not None:
                assert tokens == runner.expected_tokens(prompt, max_tokens), rid

    try:
        asyncio.run(wave("a"))
        asyncio.run(wave("b"))
        deadline = 200
        while (core.has_unfinished_requests() or runner.rows_in_use) and deadline:
            deadline -= 1
            asyncio.run(asyncio.sleep(0.01))
        assert engine.is_healthy
        assert runner.peak_rows == MAX_SEQS
        assert_all_released(core, runner)
    finally:
        engine.shutdown()
