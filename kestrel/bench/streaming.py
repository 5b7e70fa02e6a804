"""`kestrel bench streaming`: attention sinks + window (streaming_window) on a long stream, teacher-forced.

The held-out stdlib files (the ppl bench's split) are concatenated, each one after the separator (bos), into one
stream of `--tokens` tokens, and fed to kestrel-tiny as one sequence whose every token is scored given the tokens
before it that the cache holds (the sinks and the window): the stream enters the engine's scheduler as one request
with prompt logprobs, in chunks of `--chunk` tokens; between chunks the blocks that left the window are freed. (The
engine refuses user prompts longer than sinks + window; the bench hands the scheduler its request directly, which
is the same attention as generating the stream token by token, each query reading its own sinks and window.)
Reported: perplexity per `--segment` tokens of the stream and over all of it, KV blocks in use after every step
(the maximum must stay bounded), tokens/s; and, for reference, the dense model's perplexity on the same stream cut
into non-overlapping windows of its own context (`--context`, 512 for kestrel-tiny).
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kestrel.bench import register_suite, standalone_main
from kestrel.bench.common import Engine, build_engine, pyplot, report, save_figure
from kestrel.bench.ppl import load_documents
from kestrel.config import ConfigError
from kestrel.engine.contracts import run_step
from kestrel.kv_spec import SinkWindowSpec
from kestrel.loader.tokenizer import load_tokenizer
from kestrel.request import Request
from kestrel.sampling_params import SamplingParams
from kestrel.tiny import corpus, default_model_path

BLOCK_SIZE = 16


def stream_tokens(tokenizer: Any, num_tokens: int) -> list[int]:
    """The held-out documents, each starting with the separator, concatenated and cut at `num_tokens`; cycled
    through again if they are shorter."""
    eval_set = [f for f in corpus.eval_files() if f.path.stat().st_size > 0]
    documents = load_documents(tokenizer, eval_set)
    if not documents:
        raise ConfigError(f"no held-out files under {corpus.stdlib_root()}")
    tokens: list[int] = []
    while len(tokens) < num_tokens:
        for doc in documents:
            tokens.extend(doc.token_ids)
            if len(tokens) >= num_tokens:
                break
    return tokens[:num_tokens]


def score_prompts(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[float]], list[int], float]:
    """Teacher-forced logprob of every prompt token after the first, per prompt (their requests handed to the
    scheduler directly, admitted in order), blocks in use after each step, seconds."""
    scheduler, runner = engine.core.scheduler, engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    logprobs: dict[str, list[float]] = {}
    for index, prompt in enumerate(prompts):
        scheduler.add_request(Request(str(index), prompt, params))
        logprobs[str(index)] = []
    pool = scheduler.kv.pool
    blocks_in_use: list[int] = []
    started = time.perf_counter()
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        result = run_step(runner, output)
        blocks_in_use.append(pool.num_blocks - pool.num_free_blocks)
        for request_id, entries in result.prompt_logprobs.items():
            scored, prompt = logprobs[request_id], prompts[int(request_id)]
            for entry in entries:
                if entry is not None:
                    scored.append(entry[prompt[len(scored) + 1]].logprob)
        scheduler.update(output, result)
    return [logprobs[str(i)] for i in range(len(prompts))], blocks_in_use, time.perf_counter() - started


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    if not 0 < args.chunk <= BLOCK_SIZE:
        # A request's block list is bounded for steps of at most a block (decodes, prompts within sinks + window).
        raise ConfigError(f"invalid --chunk={args.chunk}: expected 1 to the block size {BLOCK_SIZE}")
    model = args.model or str(default_model_path())
    streaming = {"sink_tokens": args.sink_tokens, "window": args.window}
    spec = SinkWindowSpec(1, 1, window=args.window, sink_tokens=args.sink_tokens)
    stream = build_engine(model, device="cpu", dtype="float32", max_model_len=args.context,
                          streaming_window=streaming, kv_cache_blocks=spec.max_blocks_per_request(BLOCK_SIZE) + 4,
                          max_num_seqs=1, max_num_batched_tokens=args.chunk, disable_log_stats=True)
    tokens = stream_tokens(load_tokenizer(model), args.tokens)
    (logprobs,), blocks_in_use, seconds = score_prompts(stream, [tokens])
    pool_blocks = stream.core.scheduler.kv.pool.num_blocks
    del stream
    if len(logprobs) != len(tokens) - 1:
        raise RuntimeError(f"scored {len(logprobs)} of {len(tokens) - 1} stream tokens")
    segments = []
    for start in range(0, len(logprobs), args.segment):
        part = logprobs[start: start + args.segment]
        segments.append({"first_token": start + 1, "tokens": len(part), "perplexity": math.exp(-sum(part) / len(part))})
    stream_nll = -sum(logprobs) / len(logprobs)
    dense = build_engine(model, device="cpu", dtype="float32", max_model_len=args.context,
                         enable_prefix_caching=False, disable_log_stats=True)
    prefix = tokens[: args.dense_tokens]
    # Non-overlapping windows of context - 1 tokens (the engine keeps a slot for the token it would generate).
    windows = [prefix[i: i + args.context - 1] for i in range(0, len(prefix), args.context - 1)]
    dense_logprobs = [lp for scored in score_prompts(dense, [w for w in windows if len(w) > 1])[0] for lp in scored]
    dense_nll, dense_scored = -sum(dense_logprobs) / len(dense_logprobs), len(dense_logprobs)
    return {
        "suite": "streaming", "model_dir": model, "device": "cpu", "dtype": "float32",
        "python": platform.python_version(), "stdlib": str(corpus.stdlib_root()),
        "sink_tokens": args.sink_tokens, "window": args.window, "context": args.context, "chunk": args.chunk,
        "block_size": BLOCK_SIZE, "stream_tokens": len(tokens), "scored_tokens": len(logprobs),
        "seconds": round(seconds, 1), "tokens_per_second": len(tokens) / seconds,
        "seconds_for_1m_tokens_estimate": round(1_000_000 / (len(tokens) / seconds)),
        "perplexity": math.exp(stream_nll), "segments": segments,
        "kv_blocks": {"max_in_use": max(blocks_in_use), "bound": spec.max_blocks_per_request(BLOCK_SIZE),
                      "pool": pool_blocks,
                      "in_use_per_step": blocks_in_use[:: max(1, len(blocks_in_use) // 2000)],
                      "step_stride": max(1, len(blocks_in_use) // 2000), "steps": len(blocks_in_use)},
        "dense_reference": {"perplexity": math.exp(dense_nll), "scored_tokens": dense_scored,
                            "windows_of": args.context - 1,
                            "stream_prefix_tokens": min(args.dense_tokens, len(tokens))},
    }


def plot(result: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7))
    seg = result["segments"]
    ax1.plot([s["first_token"] + s["tokens"] / 2 for s in seg], [s["perplexity"] for s in seg], marker="o",
             label=f"sinks {result['sink_tokens']} + window {result['window']}")
    ax1.axhline(result["dense_reference"]["perplexity"], color="gray", linestyle="--",
                label=f"dense, {result['context'] - 1}-token windows")
    ax1.set_xlabel("stream position (tokens)")
    ax1.set_ylabel(f"perplexity per {seg[0]['tokens']} tokens")
    ax1.legend()
    kv = result["kv_blocks"]
    steps = [i * kv["step_stride"] * result["chunk"] for i in range(len(kv["in_use_per_step"]))]
    ax2.plot(steps, kv["in_use_per_step"], label="KV blocks in use")
    ax2.axhline(kv["bound"], color="red", linestyle="--", label="bound (sink blocks + window blocks + 2)")
    ax2.set_xlabel("stream position (tokens)")
    ax2.set_ylabel("blocks")
    ax2.legend()
    fig.suptitle(f"kestrel-tiny streaming, {result['stream_tokens']:,} tokens, {result['tokens_per_second']:.0f} tok/s")
    return save_figure(plt, fig, path)


def summary(result: dict[str, Any]) -> str:
    kv = result["kv_blocks"]
    return "\n".join([
        f"{result['stream_tokens']:,} tokens, sinks {result['sink_tokens']} + window {result['window']}: perplexity "
        f"{result['perplexity']:.3f} (dense in {result['context']}-token windows: "
        f"{result['dense_reference']['perplexity']:.3f})",
        f"KV blocks in use: max {kv['max_in_use']} (bound {kv['bound']}, pool {kv['pool']}) over {kv['steps']} steps",
        f"{result['tokens_per_second']:.0f} tokens/s; 1M tokens would take about "
        f"{result['seconds_for_1m_tokens_estimate'] / 3600:.1f} h",
    ])


def register(subparsers) -> argparse.ArgumentParser:
    return register_suite(subparsers, "streaming", "attention sinks + window: perplexity over a long teacher-forced "
                          "stream, KV blocks in use, tokens/s (CPU, kestrel-tiny)", add_arguments, run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: the bundled kestrel-tiny)")
    p.add_argument("--tokens", type=int, default=50_000, help="stream length")
    p.add_argument("--sink-tokens", type=int, default=4)
    p.add_argument("--window", type=int, default=508)
    p.add_argument("--context", type=int, default=512, help="max_model_len (the dense reference's windows)")
    p.add_argument("--chunk", type=int, default=16, help="stream tokens per step, at most the block size (16)")
    p.add_argument("--segment", type=int, default=5000, help="tokens per reported perplexity")
    p.add_argument("--dense-tokens", type=int, default=50_000, help="stream prefix scored by the dense reference")
    p.add_argument("--result-file", type=Path, default=None, help="write the JSON here (and the PNG beside it)")


def run(args: argparse.Namespace) -> int:
    result = run_bench(args)
    report(result, summary(result), args.result_file, plot)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return standalone_main("streaming", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
