"""`kestrel bench cpu-throughput`: offline throughput on the CPU (`LLM.generate`'s loop on the engine core), the
fast CPU paths (`kernels/cpu/`) against the references they replace (`ops.cpu_references()`), in one process,
interleaved.

The issue's setup (issue 33): kestrel-tiny (or `--model`), float32, `--num-prompts` prompts of `--input-len`
token ids cut from the standard library's source (the tokenizer's ids of consecutive held-out files), `--output-len`
greedy tokens each with ignore_eos. One engine serves every run; each round runs every variant (fast / reference,
at each `--threads` count) once, the order alternating between rounds, so a shared machine's load falls on all of
them alike; the report gives each variant's median output tok/s and checks that every variant produced the same
tokens. The load average is recorded with the result.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from kestrel.bench import common, register_suite, standalone_main
from kestrel.bench.cpu_step_budget import cpu_environment

PATHS = ("fast", "reference")


def stdlib_prompts(tokenizer: Any, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` token ids: consecutive windows of the held-out stdlib files' tokens."""
    from kestrel.tiny import corpus

    ids: list[int] = []
    for _, text in corpus.iter_texts(corpus.eval_files()):
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        if len(ids) >= count * length:
            break
    if len(ids) < count * length:
        raise RuntimeError(f"the stdlib corpus gave {len(ids)} tokens; {count * length} are needed")
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def generate_once(engine: common.Engine, prompts: list[list[int]], output_len: int,
                  tag: str) -> tuple[float, list[list[int]]]:
    """What `LLM.generate` does with token-id prompts (final-only outputs), on the engine core: every prompt
    added, steps until all finish; seconds and each prompt's output ids."""
    from kestrel.sampling_params import SamplingParams

    core = engine.core
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, output_kind="final_only")
    start = time.perf_counter()
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        core.add_request(rid, prompt, params)
    outputs: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    return time.perf_counter() - start, [outputs[rid] for rid in ids]


def run(args: argparse.Namespace) -> int:
    from kestrel import ops
    from kestrel.config import ConfigError
    from kestrel.loader.tokenizer import load_tokenizer
    from kestrel.tiny import default_model_path

    if args.smoke:
        args.num_prompts, args.input_len, args.output_len, args.rounds = 4, 12, 4, 1
    threads = [int(t) for t in str(args.threads).split(",") if t] if args.threads else []
    if any(t < 1 for t in threads):
        raise ConfigError(f"invalid --threads {args.threads!r}: expected positive counts")
    model = args.model or str(default_model_path())
    # LLM(model)'s engine: the default scheduler limits, prefix caching off (the runs repeat the prompts).
    engine = common.build_engine(model, dtype=args.dtype, device="cpu", enable_prefix_caching=False,
                                 max_model_len=args.input_len + args.output_len + 1)
    threads = threads or [torch.get_num_threads()]  # the engine's default (`cpu_threads`)
    prompts = stdlib_prompts(load_tokenizer(engine.config.model.tokenizer_path), args.num_prompts, args.input_len)
    variants = [(path, t) for t in threads for path in args.paths.split(",")]
    for path, _ in variants:
        if path not in PATHS:
            raise ConfigError(f"invalid --paths entry {path!r}: use " + ", ".join(PATHS))
    generate_once(engine, prompts[:2], 4, "warm-up")
    seconds: dict[str, list[float]] = {}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        for path, count in (variants if r % 2 == 0 else variants[::-1]):
            torch.set_num_threads(count)
            with ops.cpu_references() if path == "reference" else nullcontext():
                elapsed, out = generate_once(engine, prompts, args.output_len, f"{path}-{count}-{r}")
            key = f"{path}/{count}t"
            seconds.setdefault(key, []).append(elapsed)
            tokens.setdefault(key, out)
            common.log(f"round {r}: {key}: {args.num_prompts * args.output_len / elapsed:.1f} out tok/s")
    out_tokens = args.num_prompts * args.output_len
    rows = {key: {"path": key.split("/")[0], "threads": int(key.split("/")[1][:-1]),
                  "median_s": round(common.median(s), 3),
                  "output_tok_per_s": round(out_tokens / common.median(s), 1),
                  "runs_s": [round(x, 3) for x in s]} for key, s in seconds.items()}
    first = next(iter(tokens.values()))
    result = {"suite": "cpu_throughput", "complete": True,
              "config": {"model": Path(model).name, "dtype": args.dtype, "num_prompts": args.num_prompts,
                         "input_len": args.input_len, "output_len": args.output_len, "rounds": args.rounds,
                         "threads": threads, "smoke": args.smoke},
              "environment": cpu_environment(), "results": rows,
              "identical_tokens": all(t == first for t in tokens.values())}
    common.report(result, summary(result), args.result_file, plot)
    return 0 if result["identical_tokens"] else 1


def summary(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"offline LLM.generate on the CPU: {cfg['model']} {cfg['dtype']}, {cfg['num_prompts']} prompts x "
             f"{cfg['input_len']} tokens, {cfg['output_len']} greedy out, median of {cfg['rounds']} interleaved rounds"
             f" (load average at the end {result['environment']['load_average_at_end']})"]
    for key, row in result["results"].items():
        lines.append(f"  {key:<16}{row['output_tok_per_s']:>10.1f} out tok/s  ({row['median_s']:.2f} s)")
    for count in cfg["threads"]:
        fast, ref = result["results"].get(f"fast/{count}t"), result["results"].get(f"reference/{count}t")
        if fast and ref:
            ratio = fast["output_tok_per_s"] / ref["output_tok_per_s"]
            lines.append(f"  fast / reference at {count} threads: {ratio:.2f}x")
    lines.append(f"  identical tokens across variants: {result['identical_tokens']}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    rows = result["results"]
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(rows)), 4.5))
    keys = list(rows)
    colors = ["tab:green" if rows[k]["path"] == "fast" else "tab:gray" for k in keys]
    bars = ax.bar(range(len(keys)), [rows[k]["output_tok_per_s"] for k in keys], color=colors)
    for bar, key in zip(bars, keys):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{rows[key]['output_tok_per_s']:.0f}",
                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(keys)), keys, fontsize=8)
    ax.set_ylabel("output tokens / s (median)")
    cfg = result["config"]
    ax.set_title(f"CPU offline throughput, {cfg['model']} {cfg['dtype']}: {cfg['num_prompts']} x {cfg['input_len']} in"
                 f" / {cfg['output_len']} out\n{result['environment']['cpu']}, {result['environment']['cores']} cores,"
                 f" load avg {result['environment']['load_average_at_end'][0]}", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory (default: the bundled kestrel-tiny)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=common.positive_int, default=64)
    p.add_argument("--input-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each runs every variant once")
    p.add_argument("--threads", default=None,
                   help="comma-separated torch thread counts, each a variant (default: the engine's, cpu_threads)")
    p.add_argument("--paths", default="fast,reference", help="comma-separated: " + ", ".join(PATHS))
    common.add_report_arguments(p)


def register(subparsers) -> argparse.ArgumentParser:
    return register_suite(subparsers, "cpu-throughput",
                          "CPU offline LLM.generate throughput: fast CPU paths vs the references, interleaved",
                          add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    return standalone_main("cpu_throughput", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
