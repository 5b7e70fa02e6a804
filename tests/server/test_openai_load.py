"""A bounded load test on the tiny model (async scheduling): two waves of 120 streaming requests at concurrency 48,
more than the server's max_num_seqs (32), some clients aborting; the engine drains between the waves."""

import asyncio
import random

import openai

MODEL = "tiny"
NUM_REQUESTS = 120
CONCURRENCY = 48  # the server runs max_num_seqs=32: the rest queue
ABORT_EVERY = 7  # every 7th client reads two chunks and hangs up


async def one_request(client: openai.AsyncOpenAI, i: int, gate: asyncio.Semaphore) -> dict:
    rng = random.Random(i)
    max_tokens = rng.randint(4, 16)
    aborts = i % ABORT_EVERY == 0
    async with gate:
        if i % 2:
            stream = await client.completions.create(model=MODEL, prompt=f"Request {i}: the quick brown fox",
                                                     max_tokens=max_tokens, stream=True, temperature=0.8, seed=i,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True})
        else:
            messages = [{"role": "user", "content": f"Hi {i}"}]
            stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                          stream=True, seed=i,
                                                          stream_options={"include_usage": True},
                                                          extra_body={"ignore_eos": True})
        finish, usage, chunks = None, None, 0
        async for chunk in stream:
            chunks += 1
            if aborts and chunks == 2:
                await stream.close()
                return {"aborted": True}
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
    return {"aborted": False, "finish": finish, "max_tokens": max_tokens, "usage": usage}


async def run_load(server) -> list[dict]:
    gate = asyncio.Semaphore(CONCURRENCY)
    async with server.async_client() as client:
        return await asyncio.gather(*(one_request(client, i, gate) for i in range(NUM_REQUESTS)))


def test_load_with_aborting_clients(openai_server):
    assert openai_server.engine.core.config.scheduler.max_num_seqs < CONCURRENCY
    before = openai_server.metrics()
    completed = []
    for _ in range(2):  # the second wave refills an engine that drained a full batch
        results = asyncio.run(run_load(openai_server))
        wave = [r for r in results if not r["aborted"]]
        assert len(wave) == NUM_REQUESTS - len(range(0, NUM_REQUESTS, ABORT_EVERY))
        for result in wave:
            assert result["finish"] == "length"
            assert result["usage"].completion_tokens == result["max_tokens"]
        completed += wave
        after = openai_server.wait_idle(timeout_s=10)
        assert after["kestrel:kv_cache_usage_perc"] == 0
        assert after["kestrel:num_requests_running"] == 0 and after["kestrel:num_requests_waiting"] == 0
        runner = openai_server.engine.core.runner
        assert runner.block_table.num_rows_in_use == 0 and not runner.requests  # the worker released every row
    finished = after["kestrel:request_success_total"] - before.get("kestrel:request_success_total", 0)
    assert finished >= len(completed)
    assert openai_server.engine.is_healthy
    assert openai_server.engine.core.async_scheduling
