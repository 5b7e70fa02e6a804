"""`kestrel bench step-budget`: where one engine step's time goes at full batch, against each part's roofline.

For each precision, the whole model (Llama-3-8B shape, random weights) runs in the engine as it serves:
async scheduling and CUDA graphs as configured, `--batch` requests of `--context` prompt tokens prefilled
and then decoding together. Per decode batch it times `--steps` steps (host wall time between step returns,
so the host work that async scheduling hides is not counted twice) and profiles `--profile-steps` more
with torch.profiler; per prefill point it times and profiles whole steps of `--prefill-tokens` prompt tokens.

Each GPU kernel is assigned a component by its name and, for the GEMMs, by its place in the step (a
decoder layer runs qkv, o, gate_up, down in that order; the LM head comes last): qkv, o, gate_up, down,
lm_head, attention, norms/RoPE/activation, activation quantization, embedding/sampler/other, and the host
gap (wall time with the GPU idle). Each component's floor is max(FLOPs / peak, bytes / bandwidth) for the
step's own shapes and the ceilings measured in the same run. The batch really decoded in the profiled steps
is checked (every request still running, none waiting), and the mean context is reported.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from kestrel.bench import common, register_suite, standalone_main

GEMMS = ("qkv", "o", "gate_up", "down")
COMPONENTS = (*GEMMS, "lm_head", "attention", "norm_rope_act_quant", "embed_sampler_other", "host_gap")
PRECISIONS = {"bf16": (None, "auto"), "fp8": ("fp8", "fp8"), "int8": ("int8", "auto")}


# ------------------------------------------------------------------------------------------------ kernels


def kernel_kind(name: str) -> str:
    """gemm (a GEMM's main kernel), gemm_tail (split-K reduction of the GEMM before it), or a component."""
    lowered = name.lower()
    if "splitkreduce" in lowered:
        return "gemm_tail"
    if "paged_attn" in lowered or "merge_splits" in lowered:
        return "attention"
    # One component: the activation quantizer is also the kernel of the fused RMSNorm / SiLU-mul producers.
    if any(k in lowered for k in ("rms_norm", "silu", "rope", "store_kv", "quant")):
        return "norm_rope_act_quant"
    if any(k in lowered for k in ("scaled_mm", "nvjet", "gemm", "cutlass", "xmma", "_int_mm")):
        return "gemm"
    return "embed_sampler_other"


def exclusive_durations(events: list[tuple[str, float, float]]) -> list[tuple[str, float]]:
    """(name, microseconds) in start order, each kernel charged only for the time no earlier kernel was still
    running: a kernel launched early with programmatic dependent launch waits inside itself for its producer,
    and that wait belongs to the producer. The durations add up to the GPU-busy time."""
    out, end = [], float("-inf")
    for name, start, duration in events:
        stop = start + duration
        out.append((name, max(stop - max(start, end), 0.0)))
        end = max(end, stop)
    return out


def assign_components(kernels: list[tuple[str, float]], num_layers: int, num_steps: int) -> tuple[dict, bool]:
    """Kernels in launch order (name, microseconds) of `num_steps` steps -> per-component (launches, us),
    per step. GEMMs are labelled by position: 4 per layer in the order of GEMMS, then the LM head."""
    per_step = 4 * num_layers + 1
    num_gemms = sum(1 for name, _ in kernels if kernel_kind(name) == "gemm")
    ordered = num_gemms == per_step * num_steps
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    gemm_index = -1
    last_gemm = "gemm_unassigned"
    for name, us in kernels:
        kind = kernel_kind(name)
        if kind == "gemm":
            gemm_index += 1
            position = gemm_index % per_step
            last_gemm = ("lm_head" if position == per_step - 1 else GEMMS[position % 4]) if ordered \
                else "gemm_unassigned"
            kind = last_gemm
        elif kind == "gemm_tail":
            kind = last_gemm
        totals[kind][0] += 1
        totals[kind][1] += us
    return {k: (n / num_steps, us / num_steps) for k, (n, us) in totals.items()}, ordered


def profile_kernels(run_steps, device: torch.device) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every GPU kernel and copy launched by `run_steps()`, in start order
    (on the CPU, for smoke runs: the ATen ops)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    common.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run_steps()
        common.synchronize(device)
    wanted = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    events = []
    for evt in prof.events():
        if evt.device_type == wanted and (cuda or evt.name.startswith("aten::")):
            start = evt.time_range.start
            events.append((evt.name, start, evt.time_range.end - start))
    events.sort(key=lambda e: e[1])
    return events


def busy_us(events: list[tuple[str, float, float]]) -> float:
    """Time with at least one kernel running (the union of the kernels' intervals)."""
    total, end = 0.0, float("-inf")
    for _, start, duration in events:
        stop = start + duration
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def top_kernels(events: list[tuple[str, float, float]], num_steps: int, count: int = 25) -> list[dict[str, Any]]:
    sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, _, duration in events:
        sums[name[:100]][0] += 1
        sums[name[:100]][1] += duration
    ranked = sorted(sums.items(), key=lambda kv: -kv[1][1])[:count]
    return [{"name": n, "per_step": c / num_steps, "us_per_step": round(us / num_steps, 2)} for n, (c, us) in ranked]


# ------------------------------------------------------------------------------------------------ floors


def component_floors(hf: dict[str, Any], precision: str, kv_bytes: int, tokens: int, rows: int,
                     attention_pairs: float, kv_tokens_read: int, ceilings: dict[str, float]) -> dict[str, float]:
    """Microseconds each component needs at the ceilings: `tokens` tokens through the layers, `rows` through the
    LM head and sampler, `attention_pairs` (query, key) pairs and `kv_tokens_read` cached tokens read per layer."""
    bw = ceilings["copy_TBps"] * 1e12
    bf16 = ceilings["bf16_TFLOPs"] * 1e12
    eight_bit = ceilings.get("fp8_TFLOPs", ceilings.get("eight_bit_TFLOPs", 0.0)) * 1e12
    layers, hidden, inter = hf["num_hidden_layers"], hf["hidden_size"], hf["intermediate_size"]
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    head = hf.get("head_dim") or hidden // heads
    vocab = hf["vocab_size"]
    quantized = precision in ("fp8", "int8")
    w_bytes, a_bytes, peak = (1, 1, eight_bit) if quantized else (2, 2, bf16)
    shapes = {"qkv": ((heads + 2 * kv_heads) * head, hidden), "o": (hidden, heads * head),
              "gate_up": (2 * inter, hidden), "down": (hidden, inter)}

    def floor(flops: float, nbytes: float, rate: float) -> float:
        return 1e6 * max(flops / rate, nbytes / bw)

    out = {}
    for name, (n, k) in shapes.items():
        out[name] = layers * floor(2.0 * tokens * n * k, n * k * w_bytes + tokens * k * a_bytes + tokens * n * 2, peak)
    out["lm_head"] = floor(2.0 * rows * vocab * hidden, vocab * hidden * 2 + rows * hidden * 2 + rows * vocab * 4, bf16)
    attn_bytes = kv_tokens_read * kv_heads * head * 2 * kv_bytes + tokens * (heads * head * 2 * 2)
    out["attention"] = layers * floor(4.0 * attention_pairs * heads * head, attn_bytes, bf16)
    qkv_n = shapes["qkv"][0]
    # Each activation read and written once: two RMSNorms with their residual, RoPE with the KV write,
    # SiLU-mul; the quantization passes of the inputs that no producer fuses (the o projection's at least).
    elementwise = tokens * (2 * (3 * hidden * 2 + hidden * a_bytes) + qkv_n * 2 + heads * head * 2
                            + 2 * kv_heads * head * kv_bytes + 2 * inter * 2 + inter * a_bytes)
    quant = tokens * heads * head * (2 + 1) if quantized else 0
    out["norm_rope_act_quant"] = layers * 1e6 * (elementwise + quant) / bw
    out["embed_sampler_other"] = 1e6 * (tokens * hidden * 2 + 2 * rows * vocab * 4) / bw
    out["host_gap"] = 0.0
    return out


def measure_fp8_rate(device: torch.device) -> float:
    """FP8 e4m3 GEMM TFLOP/s through cuBLASLt (`torch._scaled_mm`, tensorwise scales), 8192^3, random data."""
    n = 8192
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    fn = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return 2 * n**3 / common.median(times) / 1e6


# ------------------------------------------------------------------------------------------------ points


def kv_element_bytes(engine: common.Engine) -> int:
    return torch.empty((), dtype=engine.runner.kv_spec.dtype).element_size()


def _row(kind: str, precision: str, wall_us: float, events, num_steps: int, num_layers: int,
         floors: dict[str, float], **extra: Any) -> dict[str, Any]:
    per_component, ordered = assign_components(exclusive_durations(events), num_layers, num_steps)
    gpu_us = busy_us(events) / num_steps
    per_component["host_gap"] = (0.0, max(wall_us - gpu_us, 0.0))
    components = {}
    for name in (*COMPONENTS, "gemm_unassigned"):
        launches, us = per_component.get(name, (0.0, 0.0))
        if name == "gemm_unassigned" and not us:
            continue
        floor = floors.get(name, 0.0)
        components[name] = {"us": round(us, 1), "floor_us": round(floor, 1), "launches": launches,
                            "x_floor": round(us / floor, 2) if floor else None}
    floor_total = sum(floors.values())
    return {"kind": kind, "precision": precision, **extra, "step_us": round(wall_us, 1),
            "gpu_busy_us": round(gpu_us, 1), "gpu_busy_fraction": round(gpu_us / wall_us, 3) if wall_us else None,
            "floor_us": round(floor_total, 1), "x_floor": round(wall_us / floor_total, 2) if floor_total else None,
            "gemms_in_layer_order": ordered, "components": components,
            "kernels": top_kernels(events, num_steps)}


def decode_point(engine: common.Engine, precision: str, batch: int, context: int, steps: int, profile_steps: int,
                 vocab: int, ceilings: dict[str, float]) -> dict[str, Any]:
    from kestrel.sampling_params import SamplingParams

    core = engine.core
    hf = engine.config.model.hf_config
    params = SamplingParams(max_tokens=engine.config.model.max_model_len - context - 1, temperature=0.0,
                            ignore_eos=True, output_kind="final_only")
    ids = [f"decode{batch}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, common.random_prompts(batch, context, vocab, seed=batch)):
        core.add_request(rid, prompt, params)
    scheduler = core.scheduler
    while scheduler.waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        core.step()
    for _ in range(3):
        core.step()
    device = engine.runner.device
    common.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    wall_us = 1e6 * (time.perf_counter() - start) / steps
    contexts = [r.num_tokens for r in scheduler.running]
    running = len(scheduler.running)

    def run_steps() -> None:
        for _ in range(profile_steps):
            core.step()

    events = profile_kernels(run_steps, device)
    still_running = len(scheduler.running)
    core.abort_request(ids)
    while core.has_unfinished_requests():
        core.step()
    if running != batch or still_running != batch or scheduler.waiting:
        raise RuntimeError(f"decode batch {batch}: {running} / {still_running} requests ran in the timed / "
                           "profiled steps; the batch must stay whole (raise max_model_len or the KV cache)")
    mean_context = sum(contexts) / len(contexts)
    kv_bytes = kv_element_bytes(engine)
    floors = component_floors(hf, precision, kv_bytes, batch, batch, float(sum(contexts)), sum(contexts), ceilings)
    return _row("decode", precision, wall_us, events, profile_steps, hf["num_hidden_layers"], floors, batch=batch,
                tokens=batch, mean_context=round(mean_context, 1), timed_steps=steps)


def prefill_point(engine: common.Engine, precision: str, tokens: int, prompt_len: int, repeats: int, vocab: int,
                  ceilings: dict[str, float]) -> dict[str, Any]:
    """Whole steps of `tokens` prompt tokens (tokens // prompt_len prompts), each launched and waited for alone."""
    from kestrel.sampling_params import SamplingParams

    core = engine.core
    hf = engine.config.model.hf_config
    device = engine.runner.device
    num_prompts = max(tokens // prompt_len, 1)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, output_kind="final_only")
    walls = []
    events = []
    for r in range(repeats + 2):
        ids = [f"prefill{tokens}-{r}-{i}" for i in range(num_prompts)]
        for rid, prompt in zip(ids, common.random_prompts(num_prompts, prompt_len, vocab, seed=1000 + r)):
            core.add_request(rid, prompt, params)
        common.synchronize(device)
        if r == repeats + 1:  # the last repeat is profiled
            events = profile_kernels(core.step, device)
        else:
            start = time.perf_counter()
            core.step()
            common.synchronize(device)
            if r > 0:  # the first one warms up
                walls.append(1e6 * (time.perf_counter() - start))
        core.abort_request(ids)
        while core.has_unfinished_requests():
            core.step()
    kv_bytes = kv_element_bytes(engine)
    total = num_prompts * prompt_len
    pairs = num_prompts * (prompt_len * (prompt_len + 1) / 2)
    floors = component_floors(hf, precision, kv_bytes, total, num_prompts, pairs, total, ceilings)
    return _row("prefill", precision, common.median(walls), events, 1, hf["num_hidden_layers"], floors,
                batch=num_prompts, tokens=total, prompt_len=prompt_len, timed_steps=len(walls))


# ------------------------------------------------------------------------------------------------ report


def summary(result: dict[str, Any]) -> str:
    lines = [f"step budget ({result['config']['arch']}); ceilings: copy {result['ceilings']['copy_TBps']:.2f} TB/s, "
             f"BF16 {result['ceilings']['bf16_TFLOPs']:.0f}, FP8 {result['ceilings'].get('fp8_TFLOPs', 0):.0f} "
             "TFLOP/s; us per step (x floor)"]
    header = f"{'point':<26}{'step':>9}{'floor':>8}" + "".join(f"{c[:9]:>11}" for c in COMPONENTS)
    lines.append(header)
    for row in result["results"]:
        label = (f"{row['precision']} decode b{row['batch']} c{row['mean_context']:.0f}" if row["kind"] == "decode"
                 else f"{row['precision']} prefill {row['tokens']}t")
        cells = ""
        for c in COMPONENTS:
            entry = row["components"][c]
            ratio = f"({entry['x_floor']:.1f})" if entry["x_floor"] else ""
            cells += f"{entry['us']:>6.0f}{ratio:>5}"
        lines.append(f"{label:<26}{row['step_us']:>9.0f}{row['floor_us']:>8.0f}{cells}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    rows = result["results"]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(rows)), 6))
    colors = plt.get_cmap("tab10").colors
    labels = []
    for i, row in enumerate(rows):
        labels.append(f"{row['precision']}\n{row['kind']} b{row['batch']}\n"
                      + (f"ctx {row['mean_context']:.0f}" if row["kind"] == "decode" else f"{row['tokens']} tok"))
        for offset, key in ((-0.2, "us"), (0.2, "floor_us")):
            bottom = 0.0
            for j, c in enumerate(COMPONENTS):
                value = row["components"][c][key] / 1e3
                ax.bar(i + offset, value, 0.38, bottom=bottom, color=colors[j % 10],
                       label=c if (i == 0 and key == "us") else None, hatch=None if key == "us" else "//",
                       edgecolor="white" if key == "us" else "black", linewidth=0.3)
                bottom += value
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("ms per step (left bar: measured, right hatched: floor at the measured ceilings)")
    ax.set_title("Step-time budget: measured vs roofline per component")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# Defaults of the flags whose CPU defaults differ (kestrel.bench.cpu_step_budget.CPU_DEFAULTS).
GPU_DEFAULTS = {"batch": "256,512", "context": 1500, "prefill_tokens": "8192", "prefill_prompt_len": 1024,
                "steps": 20, "dtype": "bfloat16"}
# Flags the CPU budget has no use for (it times op families with and without the fast CPU paths).
GPU_ONLY = {"precisions": None, "profile_steps": None, "layers": None, "quantization": None,
            "kv_cache_dtype": "auto", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
            "distributed_executor_backend": None}


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_model_arguments(p)
    p.set_defaults(dtype=None)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: kestrel-tiny (or --model) by op family, fast CPU paths against the references")
    p.add_argument("--precisions", default=None, help="comma-separated: " + ", ".join(PRECISIONS) +
                   " (default fp8,bf16)")
    p.add_argument("--batch", default=None, help="comma-separated decode batch sizes (default 256,512; CPU 1,16,64)")
    p.add_argument("--context", type=int, default=None, help="prompt tokens of each decoding request (1500; CPU 100)")
    p.add_argument("--prefill-tokens", default=None, help="comma-separated prompt tokens per prefill step "
                   "(8192; CPU 1600)")
    p.add_argument("--prefill-prompt-len", type=int, default=None, help="(1024; CPU 100)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per point (20; CPU: per round, 6)")
    p.add_argument("--profile-steps", type=int, default=None, help="(default 3)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the architecture's)")
    p.add_argument("--threads", type=int, default=None, help="CPU only: torch threads (default: torch's)")
    p.add_argument("--rounds", type=int, default=None, help="CPU only: interleaved rounds of each variant (5)")
    common.add_report_arguments(p)


def register(subparsers) -> argparse.ArgumentParser:
    return register_suite(subparsers, "step-budget", "time per step component at full batch vs each one's roofline",
                          add_arguments, run)


def run(args: argparse.Namespace) -> int:
    import json
    import tempfile

    from kestrel.config import ConfigError

    common.refuse_weight_only(args, "step-budget")
    if args.device == "cpu":
        from kestrel.bench import cpu_step_budget

        given = [name for name, default in GPU_ONLY.items() if getattr(args, name) != default]
        if given:
            raise ConfigError("invalid flags for --device cpu: " + ", ".join("--" + n.replace("_", "-")
                                                                            for n in given) + " apply to CUDA only")
        return cpu_step_budget.run(args)
    if args.threads is not None or args.rounds is not None:
        raise ConfigError("invalid flags: --threads and --rounds apply to --device cpu only")
    for name, value in {**GPU_DEFAULTS, "precisions": "fp8,bf16", "profile_steps": 3}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.smoke:
        args.batch, args.context, args.prefill_tokens, args.prefill_prompt_len = "3", 20, "32", 16
        args.steps, args.profile_steps, args.dtype, args.max_num_batched_tokens = 3, 2, "float32", 32
        with tempfile.TemporaryDirectory() as tmp:
            model_dir, load_format = common.prepare_model(None, args.arch, True, Path(tmp), False, torch.device("cpu"))
            return _run(args, torch.device("cpu"), model_dir, load_format)
    if not torch.cuda.is_available():
        raise ConfigError("invalid device: the step budget profiles CUDA kernels; run it on a GPU (or --smoke)")
    config = dict(common.ARCHS[args.arch])
    if args.layers:
        config["num_hidden_layers"] = args.layers
    workdir = common.temporary_dir("kestrel-step-budget-")
    (workdir / "config.json").write_text(json.dumps(config))
    return _run(args, torch.device("cuda"), str(workdir), "dummy")


def _run(args: argparse.Namespace, device: torch.device, model_dir: str, load_format: str) -> int:
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    from kestrel.config import ConfigError

    batches = [int(b) for b in str(args.batch).split(",") if b]
    prefill = [int(t) for t in str(args.prefill_tokens).split(",") if t]
    ceilings = common.measure_ceilings(device)
    ceilings["fp8_TFLOPs"] = measure_fp8_rate(device) if device.type == "cuda" else ceilings["eight_bit_TFLOPs"]
    results: list[dict[str, Any]] = []
    environment = common.environment(device)

    def make_result(rows: list[dict[str, Any]], complete: bool) -> dict[str, Any]:
        return {"suite": "step_budget", "complete": complete,
                "config": {"arch": "tiny (smoke)" if args.smoke else args.arch,
                           "layers": config["num_hidden_layers"], "context": args.context, "batches": batches,
                           "prefill_tokens": prefill, "steps": args.steps, "profile_steps": args.profile_steps,
                           "async_scheduling": args.async_scheduling, "enforce_eager": args.enforce_eager,
                           "max_num_batched_tokens": args.max_num_batched_tokens, "smoke": args.smoke},
                "environment": environment, "ceilings": ceilings, "results": rows}

    precisions = ["bf16"] if args.smoke else args.precisions.split(",")
    for precision in precisions:
        if precision not in PRECISIONS:
            raise ConfigError(f"invalid --precisions entry {precision!r}: use " + ", ".join(PRECISIONS))
        args.quantization, args.kv_cache_dtype = PRECISIONS[precision]
        max_len = min(args.context + 2048, config.get("max_position_embeddings") or args.context + 2048)
        engine = common.build_suite_engine(args, model_dir, load_format, device, max(batches + [1]), max_len)
        vocab = common.prompt_vocab(model_dir)
        for batch in batches:
            row = decode_point(engine, precision, batch, args.context, args.steps, args.profile_steps, vocab, ceilings)
            results.append(row)
            common.log(f"{precision} decode batch {batch}: {row['step_us'] / 1e3:.2f} ms/step, floor "
                       f"{row['floor_us'] / 1e3:.2f} ms, GPU busy {row['gpu_busy_fraction']:.0%}")
            common.write_result(make_result(results, complete=False), args.result_file, quiet=True)
        for tokens in prefill:
            row = prefill_point(engine, precision, tokens, args.prefill_prompt_len, 3, vocab, ceilings)
            results.append(row)
            common.log(f"{precision} prefill {tokens} tokens: {row['step_us'] / 1e3:.2f} ms/step, floor "
                       f"{row['floor_us'] / 1e3:.2f} ms")
            common.write_result(make_result(results, complete=False), args.result_file, quiet=True)
        del engine  # the next precision sizes its KV cache from the memory this one frees
        common.release(None)
    common.report(make_result(results, complete=True), summary(make_result(results, True)), args.result_file, plot)
    return 0


def main(argv: list[str] | None = None) -> int:
    return standalone_main("step_budget", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
