"""Where a grammar-constrained decode step's time goes on a GPU host: the engine's host phases per step (wall time
of each, and how long the host waited for the device) and the device's kernel time per step, for unconstrained and
constrained runs of `kestrel bench structured`'s workload (Llama-3-8B shape, random weights, 128-token prompts).

    PYTHONPATH=. python3 scripts/h200_structured_probe.py --tokenizer TOKDIR --out OUT [--batch 64]

Writes OUT/structured-probe.json. A step whose host waits for the device is device-bound: its extra time is kernel
time; a step whose host never waits is host-bound: its extra time is the sum of the host phases."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from kestrel.bench import common
from kestrel.bench.structured import add_requests
from kestrel.loader.tokenizer import load_tokenizer
from kestrel.structured.backend import GrammarBackend
from kestrel.structured.shards import GrammarShards

PHASES: dict[str, list[tuple[float, float]]] = defaultdict(list)


def timed(owner: Any, name: str, label: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            PHASES[label].append((started, time.perf_counter()))

    setattr(owner, name, wrapper)


def instrument(core: Any) -> None:
    timed(core.scheduler, "schedule", "schedule")
    timed(core.runner, "execute_model", "execute_model")
    timed(core.runner, "sample_tokens", "sample_tokens")
    timed(core, "_advance", "advance")
    timed(core, "_emit", "emit")
    timed(core, "_process", "process")
    timed(core, "_grammar_bitmask", "grammar_bitmask")
    original_collect = core._collect_oldest

    def collect() -> Any:
        scheduler_output, handle = core._batch_queue[0]
        started = time.perf_counter()
        result = original_collect()
        PHASES["collect_wait"].append((started, time.perf_counter()))
        return result

    core._collect_oldest = collect
    timed(core.structured, "accept_many", "accept")


class FreeGrammars(GrammarBackend):
    """The grammar host work at no cost: every token accepted without advancing a matcher, every mask filled
    once with all tokens allowed (the device still copies and applies it). Its step time against a real
    backend's is the part of the overhead the host's grammar work causes."""

    def accept_many(self, new_tokens: dict[str, list[int]]) -> dict[str, int]:
        return {rid: len(tokens) for rid, tokens in new_tokens.items()}

    def bitmask(self, request_ids: list[str], drafts: dict[str, list[int]] | None = None) -> Any:
        from kestrel.engine.contracts import GrammarBitmask

        rows = [rid for rid in request_ids if rid in self._matchers]
        if getattr(self, "_all_allowed", None) is None or self._all_allowed.shape[0] < len(rows):
            self._all_allowed = self._buffer(max(1, len(rows)))
            self._all_allowed.fill_(-1)
        return GrammarBitmask(rows, self._all_allowed[:len(rows)])


def run_mode(engine: Any, backend: GrammarBackend, mode: str, batch: int, args: argparse.Namespace, vocab: int,
             tag: str, profile: bool) -> dict[str, Any]:
    core = engine.core
    add_requests(core, mode, batch, args, vocab, tag)
    first: set[str] = set()
    steps: list[tuple[float, float]] = []
    prof = None
    decode_steps = 0
    while core.has_unfinished_requests():
        decoding = len(first) == batch
        if decoding and profile and prof is None and decode_steps == 20:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                      torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
            profiled_from = len(steps)
        before = time.perf_counter()
        outputs = core.step()
        after = time.perf_counter()
        if decoding:
            decode_steps += 1
            steps.append((before, after))
        if prof is not None and decoding and len(steps) - profiled_from == 10:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            profiled = prof
            prof = None
            profile = False
        first.update(o.request_id for o in outputs if o.outputs[0].token_ids)
    result: dict[str, Any] = {"mode": mode, "batch": batch, "decode_steps": len(steps),
                              "step_ms_median": 1e3 * statistics.median(b - a for a, b in steps)}
    inside = steps[len(steps) // 4: -max(1, len(steps) // 8)]  # steady steps only
    lo, hi = inside[0][0], inside[-1][1]
    phases = {}
    for label, spans in PHASES.items():
        picked = [b - a for a, b in spans if lo <= a and b <= hi]
        phases[label] = {"calls": len(picked), "ms_per_step": 1e3 * sum(picked) / len(inside),
                         "ms_median_call": 1e3 * statistics.median(picked) if picked else 0.0}
    result["host_phases"] = phases
    if "profiled" in locals():
        events = profiled.key_averages()
        kernels = []
        for e in events:
            device_us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
            if device_us and e.device_type == torch.autograd.DeviceType.CUDA:
                kernels.append((e.key, device_us / 10, e.count / 10))
        kernels.sort(key=lambda k: -k[1])
        result["device_us_per_step"] = sum(k[1] for k in kernels)
        result["top_kernels"] = [{"name": n[:120], "us_per_step": round(u, 1), "calls_per_step": c}
                                 for n, u, c in kernels[:25]]
    PHASES.clear()
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    common.add_model_arguments(p)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    p.add_argument("--smoke", action="store_true", help="a tiny random model on the CPU: a check of the script")
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--modes", default="unconstrained,record,record+ref,record+free,digit-array",
                   help="unconstrained or schemas of kestrel bench structured; SCHEMA+ref masks with the "
                   "reference, SCHEMA+free skips the grammar's host work, SCHEMA+tN fills in N threads, "
                   "SCHEMA+wN runs N grammar workers")
    args = p.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        args.batch, args.input_len, args.output_len = 2, 8, 40
    model_dir, load_format = common.prepare_model(args.model, args.arch, args.smoke, args.weights_dir, False, device)
    engine = common.build_suite_engine(args, model_dir, load_format, device, args.batch,
                                       args.input_len + args.output_len + 1)
    tokenizer = load_tokenizer(args.tokenizer or model_dir)
    backend = GrammarBackend(tokenizer, engine.runner.vocab_size, engine.runner.eos_token_ids,
                             gpu_host=device.type == "cuda")
    free = FreeGrammars(tokenizer, engine.runner.vocab_size, engine.runner.eos_token_ids,
                        gpu_host=device.type == "cuda")
    free._tokenizer_info = backend.tokenizer_info
    engine.core.structured = backend
    default_threads = backend._fill_threads
    sharded: dict[int, GrammarShards] = {}
    instrument(engine.core)
    timed(free, "accept_many", "accept")
    vocab = min(common.prompt_vocab(model_dir), tokenizer.vocab_size)
    results = []
    from kestrel import ops
    from kestrel.kernels import token_bitmask

    kernel = ops.apply_token_bitmask
    for name in args.modes.split(","):
        # "SCHEMA+ref": the grammar mask applied by the PyTorch reference instead of the Triton kernel
        # "SCHEMA+free": the grammar's host work at no cost (FreeGrammars)
        mode, _, variant = name.partition("+")
        ops.apply_token_bitmask = token_bitmask.apply_token_bitmask_ref if variant == "ref" else kernel
        # "SCHEMA+wN": the matchers in N grammar worker processes (GrammarShards)
        if variant.startswith("w"):
            workers = int(variant[1:])
            if workers not in sharded:
                sharded[workers] = GrammarShards(tokenizer, engine.runner.vocab_size, engine.runner.eos_token_ids,
                                                 workers, args.batch, gpu_host=device.type == "cuda")
                sharded[workers]._tokenizer_info = backend.tokenizer_info
                timed(sharded[workers], "accept_many", "accept")
            engine.core.structured = sharded[workers]
        else:
            engine.core.structured = free if variant == "free" else backend
        # "SCHEMA+tN": the mask filled in N of xgrammar's threads (default: the backend's own choice)
        backend._fill_threads = int(variant[1:]) if variant.startswith("t") else default_threads
        backend._batch = None
        run_mode(engine, backend, mode, args.batch, args, vocab, f"{mode}-warm", profile=False)
        for repeat in range(2):
            profile = repeat == 0 and device.type == "cuda"
            r = run_mode(engine, backend, mode, args.batch, args, vocab, f"{mode}-{repeat}", profile=profile)
            r["variant"] = variant or "default"
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "top_kernels"}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured-probe.json").write_text(json.dumps({"results": results,
                                                            "environment": common.environment(device)}, indent=1))
    common.release(engine)


if __name__ == "__main__":
    main()
