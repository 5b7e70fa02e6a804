"""`kestrel bench host-step`: the engine's host time per decode step, by phase, without a device.

EngineCore drives B requests (random prompts, `--output-len` tokens, EOS ignored) with a worker whose forward costs
nothing (`NullRunner`: the runner's two verbs, tokens picked on the host), unconstrained and constrained by the
`record` JSON schema of `kestrel bench structured` (the real GrammarBackend, compiled against `--tokenizer`, the
detokenizer on the same tokenizer). Under async scheduling a constrained step runs execute_model(N+1), collects
step N (its handle's result, scheduler update, grammar accept, outputs), fills N+1's bitmask, then
sample_tokens(N+1); so on a device all of this is host work that must fit under one forward.

Reported per mode, the median over `--repeats` runs of the median over the steps in which all B requests decode,
in ms per step: each phase (schedule, runner execute_model, fill, sample_tokens, collect, scheduler update,
grammar accept, the rest of collecting outputs: detokenization, RequestOutputs) and the step's total, and the
tail of the step's total (its 99th percentile and maximum over the steps, medians over the runs): the full garbage
collections a median hides. `--serving-gc` sets the garbage collector as `kestrel serve` does. The NullRunner's
own work (choosing a token allowed by each row's mask) stands in for the device and is left out of every number.

This measures the host CPU it runs on (a development machine is not the GPU host); compare before/after on the
same machine. `--smoke`: kestrel-tiny's tokenizer, small batch, one repeat (a check of the script).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kestrel.bench import register_suite, standalone_main
from kestrel.bench.common import percentile
from kestrel.config import ConfigError, EngineConfig
from kestrel.engine.contracts import GrammarBitmask, ModelRunnerOutput, Ready, SchedulerOutput
from kestrel.engine.core import EngineCore
from kestrel.engine.serving_gc import tune_for_serving
from kestrel.sampling_params import SamplingParams, StructuredOutputsParams
from kestrel.tiny import default_model_path

MODES = ("unconstrained", "unconstrained_sync", "constrained")
# Phases in step order; "step" is the whole EngineCore.step(), "other" what no phase covers.
PHASES = ("schedule", "forward", "mask_fill", "sample", "collect", "update", "grammar_accept", "outputs")


@dataclass
class _Row:
    known: int  # tokens the host would know (prompt + collected)
    computed: int = 0
    pending: int = 0


@dataclass
class _Step:
    req_ids: list[str]
    sampling: list[str]
    tokens: list[int] = field(default_factory=list)


@dataclass
class _Handle:
    runner: NullRunner
    step: _Step

    def result(self) -> ModelRunnerOutput:
        return self.runner.collect(self.step)


class NullRunner:
    """A worker whose device work is free: `execute_model` records which rows sample, `sample_tokens` picks each
    sampled row's token (a random one its grammar row allows, when constrained), its handle's `result()` returns
    them (`collect`). The time spent picking tokens (the stand-in for the device) accumulates in
    `device_seconds`."""

    def __init__(self, vocab_size: int, eos_token_id: int | None, seed: int = 0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.rows: dict[str, _Row] = {}
        self.rng = random.Random(seed)
        self.device_seconds = 0.0
        self._executed: _Step | None = None

    def execute_model(self, out: SchedulerOutput, non_block: bool = False) -> ModelRunnerOutput | Ready | None:
        step = self.forward(out)
        if out.is_empty:  # it only releases requests
            output = self.collect(step)
            return Ready(output) if non_block else output
        self._executed = step
        return Ready() if non_block else None

    def sample_tokens(self, grammar: GrammarBitmask | None, non_block: bool = False) -> ModelRunnerOutput | _Handle:
        step, self._executed = self._executed, None
        handle = _Handle(self, self.sample(step, grammar))
        return handle if non_block else handle.result()

    def forward(self, out: SchedulerOutput) -> _Step:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.rows.pop(rid, None)
        for new in out.new_requests:
            self.rows[new.req_id] = _Row(len(new.token_ids), new.num_computed_tokens)
        req_ids = list(out.num_scheduled_tokens)
        sampling = []
        for rid in req_ids:
            row = self.rows[rid]
            row.computed += out.num_scheduled_tokens[rid]
            if row.computed >= row.known + row.pending:
                row.pending += 1
                sampling.append(rid)
        return _Step(req_ids, sampling)

    def sample(self, step: _Step, grammar: GrammarBitmask | None = None) -> _Step:
        started = self.clock()
        masks = {} if grammar is None else {rid: i for i, rid in enumerate(grammar.req_ids)}
        step.tokens = [self._pick(grammar.bitmask[masks[rid]] if rid in masks else None)  # type: ignore[union-attr]
                       for rid in step.sampling]
        self.device_seconds += self.clock() - started
        return step

    def _pick(self, mask: Any) -> int:
        if mask is None:
            token = self.rng.randrange(1, self.vocab_size)
            return token if token != self.eos_token_id else token - 1
        words = mask.numpy()
        nonzero = words.nonzero()[0]
        word = int(nonzero[self.rng.randrange(len(nonzero))])
        bits = int(words[word]) & 0xFFFFFFFF
        allowed = [b for b in range(32) if bits >> b & 1]
        return 32 * word + allowed[self.rng.randrange(len(allowed))]

    def collect(self, step: _Step) -> ModelRunnerOutput:
        sampled = dict(zip(step.sampling, step.tokens))
        tokens: list[list[int]] = []
        for rid in step.req_ids:
            token = sampled.get(rid)
            if token is None:
                tokens.append([])
                continue
            row = self.rows.get(rid)
            if row is not None:
                row.pending -= 1
                row.known += 1
            tokens.append([token])
        return ModelRunnerOutput(step.req_ids, tokens, [None] * len(tokens))


class _PhaseClock:
    """Wraps bound methods so each call's time adds to its phase (nested phases are subtracted by the caller)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = {}
        self._wrapped: list[tuple[Any, str]] = []

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        method: Callable[..., Any] = getattr(owner, name)
        seconds, clock = self.seconds, self.clock

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = clock()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[phase] = seconds.get(phase, 0.0) + clock() - started

        setattr(owner, name, timed)
        self._wrapped.append((owner, name))

    def unwrap(self) -> None:
        for owner, name in self._wrapped:
            delattr(owner, name)  # the class's method again
        self._wrapped.clear()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: kestrel-tiny's 8k BPE; "
                   "scripts/write_bench_tokenizer.py writes the 76k one the GPU benchmark uses)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)}")
    p.add_argument("--profile", default=None, help="write a cProfile of the measured runs to this file")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="wall: elapsed time; cpu: the engine thread's CPU time, steadier on a shared machine "
                   "(the grammar's mask fill runs on that thread here)")
    p.add_argument("--split", action="store_true", help="the engine core in its own process, as `kestrel serve "
                   "--engine-core-process` runs it: the core loop's and the client's time per step "
                   "(kestrel/bench/host_step_split.py)")
    p.add_argument("--core-deltas", action="store_true",
                   help="in this process, the engine core as `--split` runs it (token deltas out, no detokenization "
                   "or output objects: its client does those): the core's own step without the pipe, on one core")
    p.add_argument("--serving-gc", action="store_true",
                   help="the garbage collector set after set-up as `kestrel serve` sets it once its engine is built "
                   "(kestrel/engine/serving_gc.py); the tail columns show the full collections it avoids")
    p.add_argument("--output-kind", default="cumulative", choices=["cumulative", "delta"],
                   help="the requests' SamplingParams.output_kind: cumulative (the whole output every step) or "
                   "delta (each step's additions, as `kestrel serve` asks for streamed requests)")
    p.add_argument("--smoke", action="store_true", help="a tiny run, a check of the script")


def run(args: argparse.Namespace) -> int:
    from kestrel.bench.structured import SCHEMAS
    from kestrel.loader.tokenizer import load_tokenizer
    from kestrel.structured.backend import GrammarBackend

    if args.smoke:
        args.batch, args.input_len, args.output_len, args.repeats = 4, 8, 32 if args.split else 8, 1
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        raise ConfigError(f"invalid --modes={args.modes!r}; use names of {list(MODES)}")
    if args.split and args.core_deltas:
        raise ConfigError("--core-deltas measures the core in this process; --split runs it in its own: pick one")
    tokenizer_dir = args.tokenizer or str(default_model_path())
    if not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        raise ConfigError(f"invalid --tokenizer={tokenizer_dir!r}: no tokenizer.json there")
    tokenizer = load_tokenizer(tokenizer_dir)
    vocab_size = len(tokenizer)
    eos = tokenizer.eos_token_id
    backend = GrammarBackend(tokenizer, vocab_size, frozenset({eos} - {None}))
    schema = StructuredOutputsParams(json=SCHEMAS["record"], disable_any_whitespace=True)
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
    print(f"host-step: batch {args.batch}, input {args.input_len}, output {args.output_len}, "
          f"tokenizer {tokenizer_dir} ({vocab_size} tokens), {args.repeats} repeats, {args.clock} clock, "
          f"{args.output_kind} outputs",
          file=sys.stderr)
    if args.serving_gc:
        tune_for_serving()
    results: dict[str, dict[str, float]] = {}
    if args.split:
        from kestrel.bench.host_step_split import measure_split, split_summary

        for mode in modes:
            config = _config(mode, args, tokenizer_dir)
            samples = [measure_split(mode, args, config, NullRunner, vocab_size, _num_blocks(args, config), schema, r)
                       for r in range(args.repeats)]  # each run is a fresh core process
            results[mode] = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
        print(split_summary(results))
        return 0
    for mode in modes:
        samples = [_measure(mode, args, tokenizer, vocab_size, eos, backend, schema,
                            profiler if r > 0 else None, r)
                   for r in range(args.repeats + 1)][1:]  # the first run warms up (compiles the grammar)
        results[mode] = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    print(summary(results))
    if profiler is not None:
        profiler.dump_stats(args.profile)
    return 0


def _measure(mode: str, args: argparse.Namespace, tokenizer: Any, vocab_size: int, eos: int | None,
             backend: Any, schema: StructuredOutputsParams, profiler: Any, repeat: int) -> dict[str, float]:
    config = _config(mode, args)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    runner = NullRunner(vocab_size, eos, seed=repeat, clock=clock)
    core = EngineCore(config, runner, _num_blocks(args, config), tokenizer, eos,
                      structured=backend if mode == "constrained" else None,
                      detokenize=not args.core_deltas, deltas=args.core_deltas)
    phases = _PhaseClock(clock)
    for name, phase in (("schedule", "schedule"), ("update", "update")):
        phases.wrap(core.scheduler, name, phase)
    for name, phase in (("forward", "forward"), ("sample", "sample"), ("collect", "collect")):
        phases.wrap(runner, name, phase)
    # The scheduler update and grammar accept run in _advance (their own phases), the text and outputs in _emit.
    phases.wrap(core, "_advance", "outputs")
    phases.wrap(core, "_emit", "outputs")
    if mode == "constrained":
        phases.wrap(backend, "accept_many", "grammar_accept")
        phases.wrap(backend, "bitmask", "mask_fill")
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True,
                            structured_outputs=schema if mode == "constrained" else None,
                            output_kind=args.output_kind)
    rng = random.Random(repeat)
    for i in range(args.batch):
        core.add_request(f"r{i}", [rng.randrange(1, vocab_size) for _ in range(args.input_len)], params)
    per_step: dict[str, list[float]] = {p: [] for p in (*PHASES, "other", "step")}
    started: set[str] = set()
    if profiler is not None:
        profiler.enable()
    try:
        while core.has_unfinished_requests():
            decoding = len(started) == args.batch
            phases.seconds.clear()
            device_before = runner.device_seconds
            before = clock()
            outputs = core.step()
            total = clock() - before
            started.update(o.request_id for o in outputs)
            if not decoding or not core.has_unfinished_requests():
                continue
            s = dict(phases.seconds)
            s["sample"] = s.get("sample", 0.0) - (runner.device_seconds - device_before)
            # Collecting outputs covers the scheduler update and the grammar accept: its own share is the rest.
            s["outputs"] = s.get("outputs", 0.0) - s.get("update", 0.0) - s.get("grammar_accept", 0.0)
            total -= runner.device_seconds - device_before
            for phase in PHASES:
                per_step[phase].append(1e3 * s.get(phase, 0.0))
            per_step["other"].append(1e3 * (total - sum(s.get(p, 0.0) for p in PHASES)))
            per_step["step"].append(1e3 * total)
    finally:
        if profiler is not None:
            profiler.disable()
        phases.unwrap()
    if not per_step["step"]:
        raise RuntimeError("no step had every request decoding; raise --output-len")
    return {**{k: statistics.median(v) for k, v in per_step.items()},
            "step_p99": percentile(per_step["step"], 0.99), "step_max": max(per_step["step"])}


def _config(mode: str, args: argparse.Namespace, tokenizer_dir: str | None = None) -> EngineConfig:
    return EngineConfig.from_kwargs(str(default_model_path()), max_model_len=args.input_len + args.output_len + 16,
                                    max_num_seqs=args.batch, max_num_batched_tokens=max(2048, args.batch),
                                    async_scheduling=mode != "unconstrained_sync", device="cpu",
                                    enable_prefix_caching=False, generation_config="vllm", tokenizer=tokenizer_dir)


def _num_blocks(args: argparse.Namespace, config: EngineConfig) -> int:
    return args.batch * -(-(args.input_len + args.output_len + 16) // config.cache.block_size) + 16


def summary(results: dict[str, dict[str, float]]) -> str:
    columns = (*PHASES, "other", "step", "step_p99", "step_max")
    lines = ["host ms per decode step (medians over the steps; step_p99 and step_max: the tail of the step's "
             "total, garbage collections included)", f"{'mode':<20}" + "".join(f"{c:>15}" for c in columns)]
    for mode, row in results.items():
        lines.append(f"{mode:<20}" + "".join(f"{row[c]:>15.3f}" for c in columns))
    return "\n".join(lines)


def register(subparsers) -> argparse.ArgumentParser:
    return register_suite(subparsers, "host-step", "engine host time per decode step by phase (CPU, no device)",
                          add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    return standalone_main("host_step", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
