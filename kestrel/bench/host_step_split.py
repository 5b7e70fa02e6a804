"""`kestrel bench host-step --split`: host time per decode step with the engine core in its own process, as
`kestrel serve --engine-core-process` runs it: a CoreClient in this process (detokenization, stop strings, outputs
to asyncio streams) and the core process's loop (inputs, scheduler, grammar matchers, outputs packed and sent),
over host_step's NullRunner, whose picks stand in for the device and are left out.

Reported per mode, the median over repeats of the median over the steps in which all B requests decode, in ms per
step: `core` (one turn of the core process's loop, measured in the core between consecutive steps, the
NullRunner's picks taken out), `client` (this process's handling of one step's message: detokenizing, outputs,
delivery) and `wall` (the interval between steps' messages arriving here: the slower of the two sides sets it).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kestrel.config import EngineConfig
from kestrel.engine.core import EngineCore
from kestrel.entrypoints.core_client import CoreClient
from kestrel.sampling_params import SamplingParams, StructuredOutputsParams
from kestrel.structured.backend import GrammarBackend
from kestrel.structured.compile import GrammarSource

_SETTLE_S = 0.5


class _TimedRunner:
    """host_step's NullRunner (`runner`), timing the core loop's turns: from one step's execute_model to the next,
    the runner's picks taken out; written to `out_path` when the core process stops."""

    def __init__(self, runner: Any, out_path: str) -> None:
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.eos_token_ids = frozenset({runner.eos_token_id} - {None})
        self.out_path = out_path
        self.turns: list[list[float]] = []  # [seconds, rows decoding]
        self._last: tuple[float, float] | None = None

    def execute_model(self, out: Any, non_block: bool = False) -> Any:
        runner = self.runner
        if self._last is None and not out.is_empty:
            # The core's steps take microseconds here: the first request would finish before the client has sent
            # the rest of the batch.
            time.sleep(_SETTLE_S)
        now = runner.clock()
        if self._last is not None and not out.is_empty:
            started, device = self._last
            self.turns.append([now - started - (runner.device_seconds - device), len(out.num_scheduled_tokens)])
        if not out.is_empty:
            self._last = (now, runner.device_seconds)
        return runner.execute_model(out, non_block)

    def sample_tokens(self, grammar: Any, non_block: bool = False) -> Any:
        return self.runner.sample_tokens(grammar, non_block)

    def shutdown(self) -> None:
        Path(self.out_path).write_text(json.dumps(self.turns))


@dataclass
class _Built:
    """What the core process needs of a built engine (engine_factory.BuiltEngine's fields)."""

    tokenizer: None
    runner: _TimedRunner
    core: EngineCore


def build_null_core(config: EngineConfig, eos_token_id: int | None, *, runner_class: type, vocab_size: int,
                    num_blocks: int, out_path: str) -> _Built:
    """In the core process: an engine core over the timed NullRunner (`runner_class`); the grammar vocabulary comes
    from the client, as in the server."""
    import torch

    torch.set_num_threads(1)  # as a GPU host's runner sets it (runner_setup): no idle pool spinning on the cores
    runner = _TimedRunner(runner_class(vocab_size, eos_token_id), out_path)
    structured = GrammarBackend(None, vocab_size, runner.eos_token_ids)
    core = EngineCore(config, runner, num_blocks, None, eos_token_id, structured, detokenize=False, deltas=True)
    return _Built(None, runner, core)


def measure_split(mode: str, args: argparse.Namespace, config: EngineConfig, runner_class: type, vocab_size: int,
                  num_blocks: int, schema: StructuredOutputsParams, repeat: int) -> dict[str, float]:
    fd, out_path = tempfile.mkstemp(prefix="kestrel-host-step-", suffix=".json")
    os.close(fd)
    build = functools.partial(build_null_core, runner_class=runner_class, vocab_size=vocab_size,
                              num_blocks=num_blocks, out_path=out_path)
    client = CoreClient(config, build_core=build)
    arrivals: list[tuple[float, int]] = []  # (time, sequences in the message) of each step message
    handling: list[float] = []
    on_step = client._on_step

    def timed(accepted: list[str], refused: list[Any], records: list[Any], *rest: Any) -> None:
        started = time.perf_counter()
        on_step(accepted, refused, records, *rest)
        handling.append(time.perf_counter() - started)
        arrivals.append((started, len(records)))

    client._on_step = timed  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True,
                            structured_outputs=schema if mode == "constrained" else None,
                            output_kind=args.output_kind)
    grammar = GrammarSource.of(schema) if mode == "constrained" else None
    rng = random.Random(repeat)
    prompts = [[rng.randrange(1, vocab_size) for _ in range(args.input_len)] for _ in range(args.batch)]

    async def drive() -> None:
        streams = [client.submit(f"r{i}", p, params, grammar=grammar) for i, p in enumerate(prompts)]
        client.start()  # after the submissions: its handling of the first steps would delay them

        async def drain(stream: Any) -> None:
            async for _ in stream:
                pass

        await asyncio.gather(*(drain(s) for s in streams))

    try:
        asyncio.run(drive())
    finally:
        client.shutdown()
    turns = json.loads(Path(out_path).read_text())
    Path(out_path).unlink()
    decoding = [i for i, (_, n) in enumerate(arrivals) if n == args.batch]
    if len(decoding) < 3:
        raise RuntimeError("too few steps had every request decoding; raise --output-len")
    core = [t for t, rows in turns if rows == args.batch]
    intervals = [arrivals[i][0] - arrivals[i - 1][0] for i in decoding[1:] if i - 1 in decoding]
    return {"core": 1e3 * statistics.median(core), "client": 1e3 * statistics.median(handling[i] for i in decoding),
            "wall": 1e3 * statistics.median(intervals)}


def split_summary(results: dict[str, dict[str, float]]) -> str:
    columns = ("core", "client", "wall")
    lines = ["host ms per decode step, engine core in its own process (medians)",
             f"{'mode':<20}" + "".join(f"{c:>12}" for c in columns)]
    for mode, row in results.items():
        lines.append(f"{mode:<20}" + "".join(f"{row[c]:>12.3f}" for c in columns))
    return "\n".join(lines)
