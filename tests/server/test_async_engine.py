"""AsyncEngine without HTTP: streaming, abort on close, idle sleep, refusals, queue limit, engine death."""

import asyncio
import time

import pytest

from kestrel.entrypoints.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestStream,
    RequestTimeoutError,
)
from kestrel.entrypoints.beam_search import search_async
from kestrel.entrypoints.serving import EventStreamResponse
from kestrel.outputs import CompletionOutput, RequestOutput
from kestrel.request import InvalidRequestError
from kestrel.sampling_params import BeamSearchParams, SamplingParams


def prompt(engine) -> list[int]:
    return engine.tokenizer.encode("Hello there")


def test_generate_streams_deltas_that_add_up(make_scripted_engine):
    engine, _ = make_scripted_engine(script="one two three")

    async def run():
        return [out async for out in engine.generate("r1", prompt(engine), SamplingParams(max_tokens=50))]

    outputs = asyncio.run(run())
    final = outputs[-1].outputs[0]
    assert outputs[-1].finished and final.finish_reason == "stop"
    assert final.text == "one two three"
    assert "".join(o.outputs[0].delta_text for o in outputs) == final.text
    assert [t for o in outputs for t in o.outputs[0].delta_token_ids] == final.token_ids
    assert engine.stats().kv_cache_usage == 0


def test_leaving_the_stream_early_aborts_and_frees_blocks(make_scripted_engine):
    engine, _ = make_scripted_engine(script="word " * 100, step_delay_s=0.005)

    async def run():
        stream = engine.generate("r1", prompt(engine), SamplingParams(max_tokens=200))
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await stream.aclose()

    asyncio.run(run())
    deadline = time.monotonic() + 2
    while engine.stats().kv_cache_usage > 0 or engine.stats().num_running:
        assert time.monotonic() < deadline, "the aborted request kept its blocks"
        time.sleep(0.01)
    assert engine.core.num_unfinished_requests == 0


@pytest.mark.parametrize("output_kind", ["cumulative", "delta", "final_only"])
def test_an_abort_by_id_ends_the_readers_stream_with_an_abort_output(make_scripted_engine, output_kind):
    """Another task aborts a request whose stream is being read: the reader's iteration ends with the final output,
    finish_reason "abort" and what was generated so far (vLLM's AsyncLLM.abort); an abort before the engine took
    the request ends its stream alike, with nothing generated."""
    engine, _ = make_scripted_engine(script="word " * 100, step_delay_s=0.005)
    params = SamplingParams(max_tokens=200, output_kind=output_kind)

    async def run():
        seen = []

        async def read():
            async for out in engine.generate("r1", prompt(engine), params):
                seen.append(out)

        reader = asyncio.create_task(read())
        while len(seen) < 3 and not (output_kind == "final_only" and engine.stats().num_running):
            await asyncio.sleep(0.005)
        if output_kind == "final_only":  # it shows nothing until its end: let it run a few steps
            await asyncio.sleep(0.05)
        engine.abort("r1")
        await asyncio.wait_for(reader, 5)
        early = engine.submit("r2", prompt(engine), params)
        engine.abort("r2")
        return seen, [out async for out in early]

    seen, early = asyncio.run(run())
    final = seen[-1]
    assert final.finished and not any(out.finished for out in seen[:-1])
    assert final.outputs[0].finish_reason == "abort"
    tokens = [t for out in seen for t in out.outputs[0].delta_token_ids]
    assert len(tokens) >= 3 and "".join(out.outputs[0].delta_text for out in seen) == engine.tokenizer.decode(tokens)
    if output_kind == "cumulative":
        assert final.outputs[0].token_ids == tokens
    assert early[-1].finished and early[-1].outputs[0].finish_reason == "abort"
    assert not any(out.finished for out in early[:-1])
    assert engine.core.num_unfinished_requests == 0


def test_idle_engine_sleeps(make_scripted_engine):
    engine, runner = make_scripted_engine()
    steps = runner.steps
    time.sleep(0.3)
    assert runner.steps == steps and engine.is_healthy


def test_refusal_is_raised_to_the_caller(make_scripted_engine):
    engine, _ = make_scripted_engine()

    async def run():
        async for _ in engine.generate("r1", [5] * 600, SamplingParams()):
            pass

    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(run())
    assert info.value.param == "prompt"


def test_timeout_aborts(make_scripted_engine):
    engine, _ = make_scripted_engine(script="word " * 100, step_delay_s=0.01)

    async def run():
        async for _ in engine.generate("r1", prompt(engine), SamplingParams(max_tokens=300), timeout_s=0.1):
            pass

    with pytest.raises(RequestTimeoutError):
        asyncio.run(run())
    deadline = time.monotonic() + 2
    while engine.stats().kv_cache_usage > 0:
        assert time.monotonic() < deadline, "the timed-out request kept its blocks"
        time.sleep(0.01)


def test_queue_limit_counts_waiting_sequences(make_scripted_engine):
    engine, _ = make_scripted_engine(max_queued_requests=2, max_num_seqs=1, script="word " * 100,
                                     step_delay_s=0.01)
    assert engine.max_sequences_per_request == 3

    async def run():
        streams = [engine.submit("a", prompt(engine), SamplingParams(max_tokens=100))]
        await streams[0].accepted()
        deadline = time.monotonic() + 5
        while not engine.stats().num_running:  # "a" runs; two more may wait
            assert time.monotonic() < deadline, "the first request was never scheduled"
            await asyncio.sleep(0.01)
        engine.check_capacity(2)
        streams.append(engine.submit("b", prompt(engine), SamplingParams(max_tokens=100, n=2)))
        with pytest.raises(QueueFullError):
            engine.check_capacity(1)
        for stream in streams:
            await stream.aclose()

    asyncio.run(run())


def test_engine_death_fails_pending_streams(make_scripted_engine):
    engine, runner = make_scripted_engine(script="word " * 100, step_delay_s=0.01)

    async def run():
        stream = engine.submit("r1", prompt(engine), SamplingParams(max_tokens=200))
        await stream.__anext__()
        runner.fail_at_step = runner.steps + 1
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    asyncio.run(run())
    assert not engine.is_healthy and isinstance(engine.error, RuntimeError)
    with pytest.raises(EngineDeadError):
        engine.check_capacity()


def test_a_slow_reader_gets_merged_deltas(make_scripted_engine):
    engine, _ = make_scripted_engine(script="a b c d e f g h")

    async def run():
        stream = engine.submit("r1", prompt(engine), SamplingParams(max_tokens=50, logprobs=None, n=2))
        await stream.accepted()
        # Until the last output is delivered to the stream (the core's count drops before that delivery).
        while not (stream._items and stream._items[-1].finished):
            await asyncio.sleep(0.01)
        return [out async for out in stream]

    (output,) = asyncio.run(run())
    assert output.finished
    for completion in output.outputs:
        assert completion.text == "a b c d e f g h"
        assert completion.delta_text == completion.text and completion.delta_token_ids == completion.token_ids


class _AbortLog:
    """The engine side of a RequestStream, as far as the stream calls it."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_a_reader_cancelled_as_its_output_arrives_ends_cancelled_and_aborts():
    """Its client went away (the reader is cancelled) in the turn an output arrives, with a request timeout set: the
    reader ends cancelled and the request is aborted (Python 3.11's wait_for returned the output and swallowed the
    cancellation, so the request ran on)."""
    engine = _AbortLog()

    async def main() -> None:
        stream = RequestStream(engine, "r1", deadline=time.monotonic() + 60)
        reader = asyncio.ensure_future(stream._next_item())
        for _ in range(3):
            await asyncio.sleep(0)
        stream.put(object())
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader

    asyncio.run(main())
    assert engine.aborted == ["r1"]


def test_a_reader_slower_than_the_engine_still_times_out_short_of_the_last_output():
    """A slow reader always finds an output waiting; past the deadline it gets the timeout (and the request is
    aborted) instead of the next partial output, while a finished one is still handed over."""
    engine = _AbortLog()

    def output(finished: bool) -> RequestOutput:
        return RequestOutput("r1", None, [1], [CompletionOutput(0, "a", [5], None, None)], finished)

    async def main() -> None:
        stream = RequestStream(engine, "r1", deadline=time.monotonic() - 1)
        stream.put(output(finished=False))
        with pytest.raises(RequestTimeoutError):
            await stream._next_item()
        done = RequestStream(engine, "r2", deadline=time.monotonic() - 1)
        done.put(output(finished=True))
        assert (await done._next_item()).finished

    asyncio.run(main())
    assert engine.aborted == ["r1"]


def test_the_request_timeout_bounds_a_whole_beam_search(tiny_model_dir):
    """A beam search runs one round of one-token requests per token: the server's request timeout bounds the whole
    search, not each round (which would let it run rounds x timeout)."""
    params = BeamSearchParams(beam_width=2, max_tokens=120, ignore_eos=True)
    untimed = AsyncEngine.from_args(tiny_model_dir, device="cpu", dtype="float32", max_model_len=256).start()
    try:
        started = time.monotonic()
        asyncio.run(search_async(untimed, [[5, 6, 7]], params))
        whole_s = time.monotonic() - started
    finally:
        untimed.shutdown()
    timeout_s = whole_s / 4  # each round takes far less: 120 of them
    engine = AsyncEngine.from_args(tiny_model_dir, device="cpu", dtype="float32", max_model_len=256,
                                   request_timeout_s=timeout_s).start()
    try:
        started = time.monotonic()
        with pytest.raises(RequestTimeoutError):
            asyncio.run(search_async(engine, [[5, 6, 7]], params))
        assert time.monotonic() - started < whole_s
    finally:
        engine.shutdown()


def test_an_event_stream_whose_client_left_before_the_first_event_still_ends_its_work():
    """The client is gone before the status line could even be sent: the events' generator never started, so
    closing it runs none of its cleanup; the response's on_close ends the work behind it."""
    closed: list[str] = []

    async def events():
        yield "data: never\n\n"

    async def ended() -> None:
        closed.append("work ended")

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await asyncio.sleep(3600)  # a connection whose writes never complete

    response = EventStreamResponse(events(), on_close=ended)
    asyncio.run(asyncio.wait_for(response({"type": "http"}, receive, send), 10))
    assert closed == ["work ended"]
