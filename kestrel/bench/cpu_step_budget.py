"""`kestrel bench step-budget --device cpu`: where a CPU engine step's time goes, by op family, with the fast CPU
paths (`kernels/cpu/`) and with the references they replace, measured in the same process, interleaved.

On the CPU every op finishes before the call returns, so wall-clock sections are exact: for the duration of the
bench the op families' entry points are wrapped in timers (`ops.paged_attention`, `ops.rope_store_kv` /
`store_kv`, the norms, the activations, every `F.linear` and quantized GEMM, the runner's sampling and input
building, the scheduler's `schedule` / `update`), each charged exclusively (a section inside another is taken out
of its parent), and what no section covers is `other` (the model's Python glue, embedding, the engine loop,
detokenization). Points: decode steps at each `--batch` (prompts of `--context` tokens, then every request
decoding) and whole prefill steps of `--prefill-tokens` tokens in prompts of `--prefill-prompt-len`.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kestrel import ops
from kestrel.bench import common

FAMILIES = ("attention", "gemm", "norm", "rope_kv_store", "activation", "sampler", "runner_inputs", "scheduler",
            "other")
VARIANTS = ("fast", "reference")
# Entry points of each family: (owner object, attribute name) pairs wrapped while the bench runs.
OPS_FAMILIES = {"attention": ("paged_attention",), "rope_kv_store": ("rope_store_kv", "store_kv"),
                "norm": ("rms_norm", "layer_norm", "rms_norm_quant"),
                "activation": ("act_mul", "act", "act_mul_quant", "act_quant"),
                "gemm": ("linear", "scaled_mm", "wna16_gemm", "fused_moe")}
CPU_DEFAULTS = {"batch": "1,16,64", "context": 100, "prefill_tokens": "1600", "prefill_prompt_len": 100,
                "steps": 6, "dtype": "float32", "rounds": 5}


class Sections:
    """Exclusive wall time per family: a section's own time, less the sections that ran inside it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[float]] = []  # per open section: [start, time of its children]

    def wrap(self, family: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append([time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                start, children = self._stack.pop()
                elapsed = time.perf_counter() - start
                self.seconds[family] += elapsed - children
                self.calls[family] += 1
                if self._stack:
                    self._stack[-1][1] += elapsed
        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


@contextmanager
def instrumented(engine: common.Engine, sections: Sections) -> Iterator[None]:
    """The family entry points wrapped in `sections`' timers; everything restored on exit."""
    runner, scheduler = engine.runner, engine.core.scheduler
    targets: list[tuple[Any, str, str]] = [(ops, name, family) for family, names in OPS_FAMILIES.items()
                                           for name in names]
    targets += [(F, "linear", "gemm"), (runner.sampling, "sample", "sampler"), (runner.sampling, "collect", "sampler"),
                (runner.step_inputs, "apply", "runner_inputs"), (runner.step_inputs, "prepare", "runner_inputs"),
                (scheduler, "schedule", "scheduler"), (scheduler, "update", "scheduler")]
    saved = [(owner, name, vars(owner).get(name, _MISSING)) for owner, name, _ in targets]
    try:
        for owner, name, family in targets:
            setattr(owner, name, sections.wrap(family, getattr(owner, name)))
        yield
    finally:
        for owner, name, original in reversed(saved):
            if original is _MISSING:
                delattr(owner, name)  # an instance attribute shadowing its class's method
            else:
                setattr(owner, name, original)


_MISSING = object()


def _variant(name: str) -> Any:
    return ops.cpu_references() if name == "reference" else nullcontext()


def _timed_steps(core: Any, sections: Sections, steps: int) -> dict[str, Any]:
    """Wall time and per-family time of `steps` steps (per step, microseconds)."""
    sections.reset()
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    wall = (time.perf_counter() - start) / steps
    families = {f: 1e6 * sections.seconds.get(f, 0.0) / steps for f in FAMILIES if f != "other"}
    families["other"] = max(1e6 * wall - sum(families.values()), 0.0)
    return {"step_us": 1e6 * wall, "families_us": families,
            "calls": {f: sections.calls.get(f, 0) / steps for f in FAMILIES if f != "other"}}


def _median_row(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds of the step time and of each family."""
    return {"step_us": round(common.median([s["step_us"] for s in samples]), 1),
            "families_us": {f: round(common.median([s["families_us"][f] for s in samples]), 1) for f in FAMILIES},
            "calls_per_step": samples[0]["calls"], "rounds": len(samples)}


def decode_point(engine: common.Engine, sections: Sections, batch: int, context: int, steps: int, rounds: int,
                 vocab: int) -> dict[str, Any]:
    from kestrel.sampling_params import SamplingParams

    core = engine.core
    params = SamplingParams(max_tokens=(rounds * len(VARIANTS) + 1) * steps + 8, temperature=0.0,
                            ignore_eos=True, output_kind="final_only")
    ids = [f"decode{batch}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, common.random_prompts(batch, context, vocab, seed=batch)):
        core.add_request(rid, prompt, params)
    scheduler = core.scheduler
    while scheduler.waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        core.step()
    core.step()  # warm-up
    samples: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            with _variant(variant):
                samples[variant].append(_timed_steps(core, sections, steps))
            if len(scheduler.running) != batch or scheduler.waiting:
                raise RuntimeError(f"decode batch {batch}: the batch must stay whole (raise the KV cache)")
    mean_context = sum(r.num_tokens for r in scheduler.running) / batch
    core.abort_request(ids)
    while core.has_unfinished_requests():
        core.step()
    return {"kind": "decode", "batch": batch, "tokens": batch, "mean_context_end": round(mean_context, 1),
            "steps_per_round": steps, **{v: _median_row(samples[v]) for v in VARIANTS}}


def prefill_point(engine: common.Engine, sections: Sections, tokens: int, prompt_len: int, rounds: int,
                  vocab: int) -> dict[str, Any]:
    """Whole steps of `tokens` prompt tokens (`tokens // prompt_len` prompts, one output token each)."""
    from kestrel.sampling_params import SamplingParams

    core = engine.core
    num_prompts = max(tokens // prompt_len, 1)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, output_kind="final_only")
    samples: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    order = [v for r in range(rounds) for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1])]
    for i, variant in enumerate(["fast", *order]):  # the first step warms up
        ids = [f"prefill{tokens}-{i}-{j}" for j in range(num_prompts)]
        for rid, prompt in zip(ids, common.random_prompts(num_prompts, prompt_len, vocab, seed=1000 + i)):
            core.add_request(rid, prompt, params)
        with _variant(variant):
            sample = _timed_steps(core, sections, 1)
        if i:
            samples[variant].append(sample)
        core.abort_request(ids)
        while core.has_unfinished_requests():
            core.step()
    return {"kind": "prefill", "batch": num_prompts, "tokens": num_prompts * prompt_len, "prompt_len": prompt_len,
            **{v: _median_row(samples[v]) for v in VARIANTS}}


def summary(result: dict[str, Any]) -> str:
    lines = [f"CPU step budget ({result['config']['model']}, {result['config']['dtype']}, "
             f"{result['config']['threads']} threads): us per step, fast path / reference"]
    lines.append(f"{'point':<18}{'variant':>10}{'step':>10}" + "".join(f"{f[:11]:>12}" for f in FAMILIES))
    for row in result["results"]:
        label = f"{row['kind']} b{row['batch']}" + (f" {row['tokens']}t" if row["kind"] == "prefill" else "")
        for variant in VARIANTS:
            entry = row[variant]
            cells = "".join(f"{entry['families_us'][f]:>12.0f}" for f in FAMILIES)
            lines.append(f"{label:<18}{variant:>10}{entry['step_us']:>10.0f}{cells}")
        lines.append(f"{'':<18}{'speed-up':>10}{row['reference']['step_us'] / row['fast']['step_us']:>9.2f}x")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    rows = result["results"]
    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 5.5), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, row in zip(axes[0], rows):
        for i, variant in enumerate(VARIANTS):
            bottom = 0.0
            for j, family in enumerate(FAMILIES):
                value = row[variant]["families_us"][family] / 1e3
                ax.bar(i, value, 0.6, bottom=bottom, color=colors[j % 10],
                       label=family if (ax is axes[0][0] and i == 0) else None)
                bottom += value
        ax.set_xticks(range(len(VARIANTS)), VARIANTS)
        ax.set_title(f"{row['kind']} batch {row['batch']}" + (f"\n{row['tokens']} tokens" if row["kind"] ==
                                                                "prefill" else ""), fontsize=9)
        ax.set_ylabel("ms per step")
        ax.grid(axis="y", alpha=0.3)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=len(FAMILIES), fontsize=7)
    fig.suptitle(f"CPU step budget by op family: {result['config']['model']}, {result['config']['dtype']}, "
                 f"{result['config']['threads']} threads, {result['environment']['cpu']}", fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def cpu_environment() -> dict[str, Any]:
    """The CPU and its load: the numbers of a shared machine are read against its load average."""
    env = common.environment(torch.device("cpu"))
    model = "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    env.update(cpu=model, cores=len(os.sched_getaffinity(0)), torch_threads=torch.get_num_threads(),
               load_average_at_end=[round(x, 2) for x in os.getloadavg()])
    return env


def run(args: argparse.Namespace) -> int:
    """The CPU step budget; `args` are step-budget's, with the GPU defaults replaced by CPU ones where unset."""
    from kestrel.tiny import default_model_path

    for name, value in CPU_DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.smoke:
        args.batch, args.prefill_tokens, args.prefill_prompt_len, args.context, args.steps = "1,3", "32", 16, 20, 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = args.model or str(default_model_path())
    batches = [int(b) for b in str(args.batch).split(",") if b]
    prefill = [int(t) for t in str(args.prefill_tokens).split(",") if t]
    rounds = 2 if args.smoke else args.rounds
    max_len = args.context + (rounds * len(VARIANTS) + 2) * args.steps + 16
    engine = common.build_engine(model, dtype=args.dtype, device="cpu", enable_prefix_caching=False,
                                 max_num_seqs=max(batches + [max(t // args.prefill_prompt_len, 1) for t in prefill]),
                                 max_num_batched_tokens=max([args.max_num_batched_tokens, *prefill]),
                                 max_model_len=max(max_len, args.prefill_prompt_len + 2))
    vocab = common.prompt_vocab(model)
    sections = Sections()
    results: list[dict[str, Any]] = []
    with instrumented(engine, sections):
        for batch in batches:
            results.append(decode_point(engine, sections, batch, args.context, args.steps, rounds, vocab))
            common.log(f"decode batch {batch}: {results[-1]['fast']['step_us'] / 1e3:.1f} ms/step "
                       f"(reference {results[-1]['reference']['step_us'] / 1e3:.1f})")
        for tokens in prefill:
            results.append(prefill_point(engine, sections, tokens, args.prefill_prompt_len, rounds, vocab))
            common.log(f"prefill {tokens} tokens: {results[-1]['fast']['step_us'] / 1e3:.1f} ms/step "
                       f"(reference {results[-1]['reference']['step_us'] / 1e3:.1f})")
    result = {"suite": "step_budget_cpu", "complete": True,
              "config": {"model": Path(model).name, "dtype": args.dtype, "threads": torch.get_num_threads(),
                         "context": args.context, "batches": batches, "prefill_tokens": prefill,
                         "prefill_prompt_len": args.prefill_prompt_len, "steps_per_round": args.steps,
                         "rounds": rounds, "smoke": args.smoke},
              "environment": cpu_environment(), "families": list(FAMILIES),
              "results": results}
    common.report(result, summary(result), args.result_file, plot)
    return 0
