"""The HF transformers peer of the end-to-end suites, run as a child process by `kestrel.bench.common`.

`python -m kestrel.bench.hf_peer '<task JSON>'` prints one JSON line. Tasks:
- latency: batch-1 `generate` per input length and mode (eager; static cache, which makes transformers
  compile its decode step). A streamer timestamps every token as it is copied to the host, so TTFT and
  each decode step come from one call: TTFT = first generated token - call start; ms/token = median gap.
- throughput: continuous batching (`generate_batch`) when this transformers has it, else static batches
  of `generate`; output tokens/s over the timed call, after a small warm-up call.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Distinct random prompts (never token 0; distinct so that no prefix is shared)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (count, length), generator=gen).tolist()


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class StepClock:
    """A generate() streamer that records when each chunk of tokens reaches the host."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def load(task: dict[str, Any]) -> Any:
    from transformers import AutoModelForCausalLM

    device = torch.device(task["device"])
    model = AutoModelForCausalLM.from_pretrained(task["model"], dtype=getattr(torch, task["dtype"]),
                                                 local_files_only=True).to(device).eval()
    model.generation_config.pad_token_id = 0
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(model: Any, ids: torch.Tensor, new_tokens: int, mode: str) -> tuple[float, list[float]]:
    """(TTFT seconds, decode step seconds) of one batch-1 greedy generate of exactly `new_tokens`."""
    clock = StepClock()
    extra = {"cache_implementation": "static"} if mode == "static-compile" else {}
    sync(ids.device)
    start = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, streamer=clock, **extra)
    # generate() puts the prompt first, then one chunk per generated token: keep the last new_tokens.
    stamps = clock.times[-new_tokens:]
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])]


def latency(task: dict[str, Any]) -> dict[str, Any]:
    model = load(task)
    device = torch.device(task["device"])
    rows = []
    for mode in task["modes"]:
        # Compiling recompiles per static-cache length: the compiled mode runs the shortest prompt only.
        input_lens = task["input_lens"] if mode == "eager" else [min(task["input_lens"])]
        for input_len in input_lens:
            ids = torch.tensor(random_prompts(1, input_len, task["vocab"], seed=input_len), device=device)
            for _ in range(task["warmups"] if mode == "eager" else task["warmups"] + 2):
                timed_generate(model, ids, task["output_len"], mode)
            ttfts, steps = [], []
            for _ in range(task["repeats"]):
                ttft, gaps = timed_generate(model, ids, task["output_len"], mode)
                ttfts.append(ttft)
                steps.extend(gaps)
            rows.append({"mode": mode, "batch": 1, "input_len": input_len, "output_len": task["output_len"],
                         "ttft_ms": 1e3 * median(ttfts), "decode_ms_per_token": 1e3 * median(steps),
                         "decode_steps_timed": len(steps)})
    return {"rows": rows}


def throughput(task: dict[str, Any]) -> dict[str, Any]:
    from transformers import GenerationConfig

    model = load(task)
    device = torch.device(task["device"])
    prompts = random_prompts(task["num_prompts"], task["input_len"], task["vocab"], seed=task["seed"])
    out_len = task["output_len"]
    use_cb = hasattr(model, "generate_batch") and not task.get("static_only", False)
    method = "generate_batch" if use_cb else "static_batches"
    config = GenerationConfig(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=0,
                              eos_token_id=None)
    run = _continuous if method == "generate_batch" else _static
    try:
        run(model, prompts[:4], GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=0), device, task)
        sync(device)
        start = time.perf_counter()
        output_tokens = run(model, prompts, config, device, task)
        sync(device)
    except Exception as e:  # noqa: BLE001 - a failing continuous batching falls back to static batches
        if method != "generate_batch":
            raise
        method = f"static_batches (generate_batch failed: {type(e).__name__}: {str(e)[:300]})"
        start = time.perf_counter()
        output_tokens = _static(model, prompts, config, device, task)
        sync(device)
    elapsed = time.perf_counter() - start
    return {"method": method, "num_prompts": len(prompts), "input_len": task["input_len"], "output_len": out_len,
            "elapsed_s": elapsed, "output_tokens": output_tokens, "output_tok_per_s": output_tokens / elapsed,
            "total_tok_per_s": (output_tokens + len(prompts) * task["input_len"]) / elapsed,
            "requests_per_s": len(prompts) / elapsed}


def _continuous(model: Any, prompts: list[list[int]], config: Any, device: torch.device, task: dict) -> int:
    results = model.generate_batch(inputs=prompts, generation_config=config)
    counts = [getattr(r, "generated_tokens", None) for r in results.values()]
    if len(results) != len(prompts) or any(c is None for c in counts):
        raise RuntimeError(f"generate_batch returned {len(results)} results for {len(prompts)} prompts, "
                           "or results without generated_tokens")
    return sum(len(c) for c in counts)


def _static(model: Any, prompts: list[list[int]], config: Any, device: torch.device, task: dict) -> int:
    produced = 0
    batch = task["static_batch"]
    for start in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[start: start + batch], device=device)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        produced += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return produced


def main(argv: list[str]) -> int:
    task = json.loads(argv[0])
    # No inference_mode: generate() runs under no_grad already, and compiled CUDA graphs are safer without it.
    result = latency(task) if task["kind"] == "latency" else throughput(task)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
