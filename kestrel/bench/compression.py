"""`kestrel bench compression`: what prompt compression costs in quality, and what it saves in time to first token.

Quality (`--mode quality`, any device; the defaults are a CPU run with kestrel-tiny serving and compressing):
held-out standard-library files (the CRC-32 eval split no model was trained or tuned on) give samples of a context
of `--context` served tokens ending at a line end, followed by `--continuation` tokens. Each context is shortened
at each rate by
- `compressor`: the engine's prompt compression (the served `PromptCompressor`, no protected spans);
- `random`: the same selection with random surprisals (what the scores are worth);
- `truncate`: the context's last `rate` share of tokens (dropping the oldest), the plain alternative;
and for each the continuation's perplexity given the shortened context (prompt logprobs; the continuation's
tokens are the same in every condition) and the next line's exact match (greedy, up to the line end). Rate 1.0 is
the uncompressed context. The compressor's time per 1k of its tokens is reported too.

TTFT (`--mode ttft`, meant for a GPU: `--device cuda --model DIR`): prompts of `--prompt-lengths` served tokens
(held-out text), time to the first token uncompressed and compressed at each rate, compressor time included.
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kestrel.bench import register_suite, standalone_main
from kestrel.bench.common import pyplot, report, save_figure
from kestrel.bench.ppl import KestrelScorer
from kestrel.config import ConfigError, PromptCompressorConfig
from kestrel.entrypoints.compression_plan import ScoredToken, select, text_of
from kestrel.entrypoints.prompt_compression import PromptCompressor
from kestrel.sampling_params import PromptCompression, SamplingParams
from kestrel.tiny import corpus, default_model_path

METHODS = ("compressor", "random", "truncate")
NEXT_LINE_TOKENS = 48


@dataclass(frozen=True)
class Sample:
    name: str
    context: str  # ends with a newline
    continuation_ids: list[int]  # the served tokens scored after the context
    next_line: str  # the continuation's first line, stripped


@dataclass(frozen=True)
class Shortened:
    text: str
    seconds: float  # compressor time (0 for the baselines)
    compressor_tokens: int


class ServedModel(KestrelScorer):
    """The served model's engine core (ppl's scorer): prompt logprobs and greedy next lines."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        super().__init__(model, **engine_args)
        eos = self.tokenizer.eos_token_id
        self.start = [int(self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else eos)]

    def run(self, prompts: list[list[int]], params: SamplingParams) -> list[Any]:
        """The final output of each prompt, in order (at most max_num_seqs in flight)."""
        outputs: list[Any] = [None] * len(prompts)
        pending = list(range(len(prompts)))
        in_flight = 0
        while pending or in_flight:
            while pending and in_flight < self.config.scheduler.max_num_seqs:
                index = pending.pop(0)
                self.engine.add_request(str(index), prompts[index], params)
                in_flight += 1
            for output in self.engine.step():
                if output.finished:
                    outputs[int(output.request_id)] = output
                    in_flight -= 1
        return outputs

    def continuation_nll(self, contexts: list[list[int]], continuations: list[list[int]]) -> list[float]:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True,
                                output_kind="final_only")
        prompts = [self.start + c + k for c, k in zip(contexts, continuations)]
        outputs = self.run(prompts, params)
        nll = []
        for prompt, continuation, output in zip(prompts, continuations, outputs):
            first = len(prompt) - len(continuation)
            nll.append(-sum(output.prompt_logprobs[p][prompt[p]].logprob for p in range(first, len(prompt))))
        return nll

    def next_lines(self, contexts: list[list[int]]) -> list[str]:
        params = SamplingParams(max_tokens=NEXT_LINE_TOKENS, temperature=0.0, stop=["\n"], output_kind="final_only")
        return [o.outputs[0].text.strip() for o in self.run([self.start + c for c in contexts], params)]


def make_samples(tokenizer: Any, files: int, per_file: int, context: int, continuation: int,
                 seed: int) -> list[Sample]:
    """Up to `per_file` samples from each of `files` held-out files: a context of about `context` tokens ending at a
    line end whose next line is not blank, and the `continuation` tokens after it."""
    rng = random.Random(seed)
    chosen = corpus.select_evenly([f for f in corpus.eval_files() if f.path.stat().st_size > 0], files)
    samples = []
    for f, text in corpus.iter_texts(chosen):
        lines = text.splitlines(keepends=True)
        ends, total = [], 0
        for line in lines:
            total += len(line)
            ends.append(total)
        cuts = []
        for i, end in enumerate(ends[:-1]):
            if end < 600 or not lines[i + 1].strip() or len(lines[i + 1].strip()) < 4:
                continue
            cuts.append(i)
        rng.shuffle(cuts)
        taken = 0
        for i in cuts:
            if taken >= per_file:
                break
            end = ends[i]
            ids = tokenizer.encode(text[:end], add_special_tokens=False)
            if len(ids) < context:
                continue
            start_char = _char_start_of_last_tokens(tokenizer, text[:end], context)
            rest_ids = tokenizer.encode(text[end:], add_special_tokens=False)[:continuation]
            if len(rest_ids) < continuation:
                continue
            samples.append(Sample(f"{f.rel}:{i + 2}", text[start_char:end], rest_ids, lines[i + 1].strip()))
            taken += 1
    return samples


def _char_start_of_last_tokens(tokenizer: Any, text: str, count: int) -> int:
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    start = offsets[max(0, len(offsets) - count)][0]
    return text.index("\n", start) + 1 if "\n" in text[start:-1] else start  # start at a line start


def shorten(method: str, text: str, rate: float, compressor: PromptCompressor, tokenizer: Any,
            rng: random.Random) -> Shortened:
    if rate >= 1.0:
        return Shortened(text, 0.0, 0)
    if method == "compressor":
        started = time.perf_counter()
        result = compressor.compress_text(text, PromptCompression(rate=rate))
        return Shortened(result.text or "", time.perf_counter() - started, result.compressor_tokens)
    if method == "random":
        offsets = compressor.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        scored = [ScoredToken(start, rng.random()) for start, _ in offsets]
        return Shortened(text_of(text, select(text, scored, rate, []).kept_spans), 0.0, 0)
    if method == "truncate":
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        keep = math.ceil(rate * len(offsets))
        return Shortened(text[offsets[len(offsets) - keep][0]:] if keep else "", 0.0, 0)
    raise ConfigError(f"unknown method {method!r}; expected one of {list(METHODS)}")


def run_quality(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    model = args.model or str(default_model_path())
    served = ServedModel(model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                         max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                         enable_prefix_caching=False)
    compressor = PromptCompressor(PromptCompressorConfig(args.compressor), device=args.device, dtype=args.dtype)
    if args.context + args.continuation + 1 >= served.max_model_len:
        raise ConfigError(f"--context {args.context} + --continuation {args.continuation} do not fit the served "
                          f"model's max_model_len={served.max_model_len}")
    samples = make_samples(served.tokenizer, args.files, args.per_file, args.context, args.continuation, args.seed)
    if not samples:
        raise ConfigError(f"no held-out samples under {corpus.stdlib_root()}")
    continuations = [s.continuation_ids for s in samples]
    rows = []
    base_contexts = [served.tokenizer.encode(s.context, add_special_tokens=False) for s in samples]
    for rate in [1.0, *args.rates]:
        for method in (METHODS if rate < 1.0 else ("none",)):
            rng = random.Random(args.seed)
            shortened = [shorten(method, s.context, rate, compressor, served.tokenizer, rng) for s in samples]
            contexts = [served.tokenizer.encode(s.text, add_special_tokens=False) for s in shortened]
            nll = served.continuation_nll(contexts, continuations)
            lines = served.next_lines(contexts)
            tokens = sum(len(k) for k in continuations)
            seconds = sum(s.seconds for s in shortened)
            scored = sum(s.compressor_tokens for s in shortened)
            rows.append({
                "method": method, "rate": rate,
                "achieved_rate": sum(map(len, contexts)) / sum(map(len, base_contexts)),
                "perplexity": math.exp(sum(nll) / tokens),
                "next_line_exact_match": sum(a == s.next_line for a, s in zip(lines, samples)) / len(samples),
                "compressor_seconds_per_1k_tokens": 1000 * seconds / scored if scored else None,
            })
            print(_row_line(rows[-1]), flush=True)
    baseline = rows[0]
    for row in rows:
        row["perplexity_delta"] = row["perplexity"] / baseline["perplexity"] - 1
    return {
        "suite": "compression", "mode": "quality", "model_dir": model, "compressor": compressor.config.model,
        "device": str(served.runner.device), "dtype": args.dtype, "python": platform.python_version(),
        "stdlib": str(corpus.stdlib_root()), "samples": len(samples), "files": args.files,
        "context_tokens": args.context, "continuation_tokens": args.continuation, "seed": args.seed,
        "qa": "not measured: the chat fine-tune's question/answer pairs are generated by training/tiny/qa.py from "
              "the train split and are not stored in the repository",
        "rows": rows, "seconds": round(time.perf_counter() - started, 1),
    }


def run_ttft(args: argparse.Namespace) -> dict[str, Any]:
    """TTFT of one request at a time: uncompressed, then compressed at each rate (compressor time included)."""
    started = time.perf_counter()
    model = args.model or str(default_model_path())
    longest = max(args.prompt_lengths)
    served = ServedModel(model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len or longest + 16,
                         max_num_seqs=1, max_num_batched_tokens=args.max_num_batched_tokens,
                         enable_prefix_caching=False, tokenizer=args.tokenizer, load_format=args.load_format)
    compressor = PromptCompressor(PromptCompressorConfig(args.compressor), device=args.device, dtype=args.dtype)
    text = "".join(corpus.texts(corpus.select_evenly(corpus.eval_files(), 400)))
    ids = served.tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, output_kind="final_only")
    rows = []
    for length in args.prompt_lengths:
        if len(ids) < length:
            raise ConfigError(f"the held-out text has {len(ids)} tokens, fewer than --prompt-lengths {length}")
        prompt = served.tokenizer.decode(ids[:length])
        for rate in [1.0, *args.rates]:
            times, compress_times, served_tokens = [], [], 0
            # the first run of each point is a warm-up: it compiles the kernels of the new prompt lengths
            for repeat in range(args.repeats + 1):
                t0 = time.perf_counter()
                shortened = prompt if rate >= 1.0 else compressor.compress_text(prompt, PromptCompression(rate)).text
                t1 = time.perf_counter()
                prompt_ids = served.start + served.tokenizer.encode(shortened or "", add_special_tokens=False)
                served.run([prompt_ids], params)
                served_tokens = len(prompt_ids)
                if repeat:
                    times.append(time.perf_counter() - t0)
                    compress_times.append(t1 - t0)
            ttft, compressing = _median(times), _median(compress_times)
            rows.append({"prompt_tokens": length, "rate": rate, "served_tokens": served_tokens, "ttft_s": ttft,
                         "compressor_s": compressing})
            print(f"{length:>7} tokens rate {rate:<5} -> {served_tokens:>6} served, TTFT {ttft * 1e3:9.1f} ms "
                  f"(compressor {compressing * 1e3:8.1f} ms)", flush=True)
    for row in rows:
        base = next(r for r in rows if r["prompt_tokens"] == row["prompt_tokens"] and r["rate"] == 1.0)
        row["speedup"] = base["ttft_s"] / row["ttft_s"]
    return {"suite": "compression", "mode": "ttft", "model_dir": model, "tokenizer": args.tokenizer,
            "load_format": args.load_format, "compressor": compressor.config.model,
            "device": str(served.runner.device), "dtype": args.dtype, "repeats": args.repeats, "rows": rows,
            "target": "TTFT >= 1.7x faster at rate 0.5 on an 8k prompt, compressor included",
            "seconds": round(time.perf_counter() - started, 1)}


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _row_line(row: dict[str, Any]) -> str:
    per_1k = row["compressor_seconds_per_1k_tokens"]
    return (f"{row['method']:<10} rate {row['rate']:<5} kept {row['achieved_rate']:.3f}  ppl {row['perplexity']:8.3f}"
            f"  next-line EM {row['next_line_exact_match']:.3f}" + (f"  compressor {per_1k * 1e3:.0f} ms/1k tok"
                                                                  if per_1k else ""))


def format_summary(result: dict[str, Any]) -> str:
    if result["mode"] == "ttft":
        return "\n".join(f"{r['prompt_tokens']} tokens, rate {r['rate']}: TTFT {r['ttft_s'] * 1e3:.1f} ms "
                         f"({r['speedup']:.2f}x)" for r in result["rows"])
    lines = [f"{result['samples']} held-out samples, context {result['context_tokens']} tokens, continuation "
             f"{result['continuation_tokens']} ({result['device']}, {result['dtype']})"]
    lines += [_row_line(r) + f"  ({r['perplexity_delta']:+.1%})" for r in result["rows"]]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    if result["mode"] == "ttft":
        fig, ax = plt.subplots(figsize=(6, 4))
        for length in sorted({r["prompt_tokens"] for r in result["rows"]}):
            rows = [r for r in result["rows"] if r["prompt_tokens"] == length]
            ax.plot([r["rate"] for r in rows], [r["ttft_s"] * 1e3 for r in rows], marker="o", label=f"{length}")
        ax.set(xlabel="rate (share of tokens kept)", ylabel="TTFT, ms (compressor included)")
        ax.legend(title="prompt tokens")
        return save_figure(plt, fig, path)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    base = result["rows"][0]
    for method in METHODS:
        rows = [base] + [r for r in result["rows"] if r["method"] == method]
        rates = [r["rate"] for r in rows]
        left.plot(rates, [r["perplexity"] for r in rows], marker="o", label=method)
        right.plot(rates, [r["next_line_exact_match"] for r in rows], marker="o", label=method)
    left.set(xlabel="rate (share of context tokens kept)", ylabel="continuation perplexity",
             title="held-out stdlib continuations")
    right.set(xlabel="rate (share of context tokens kept)", ylabel="next-line exact match", title="next line")
    for ax in (left, right):
        ax.invert_xaxis()
        ax.legend()
    return save_figure(plt, fig, path)


def register(subparsers) -> argparse.ArgumentParser:
    return register_suite(subparsers, "compression", "prompt compression: quality against rate on held-out code, "
                          "and TTFT with and without it", add_arguments, run)


def _rates(text: str) -> list[float]:
    rates = [float(r) for r in text.split(",") if r]
    if any(not 0.0 < r < 1.0 for r in rates):
        raise argparse.ArgumentTypeError("rates must be in (0, 1)")
    return rates


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=("quality", "ttft"), default="quality")
    p.add_argument("--model", default=None, help="the served model directory (default: the bundled kestrel-tiny)")
    p.add_argument("--compressor", default="kestrel-tiny", help="the compressor model directory or 'kestrel-tiny'")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rates", type=_rates, default=[0.8, 0.5, 0.33], help="comma-separated rates in (0, 1)")
    p.add_argument("--files", type=int, default=64, help="quality: held-out files sampled (evenly spread)")
    p.add_argument("--per-file", type=int, default=2, help="quality: samples per file")
    p.add_argument("--context", type=int, default=384, help="quality: context tokens before compression")
    p.add_argument("--continuation", type=int, default=64, help="quality: continuation tokens scored")
    p.add_argument("--seed", type=int, default=0, help="quality: sample choice and the random baseline")
    p.add_argument("--prompt-lengths", type=lambda s: [int(v) for v in s.split(",")], default=[8192, 32768],
                   help="ttft: prompt lengths in served tokens")
    p.add_argument("--repeats", type=int, default=3, help="ttft: timed runs per point (median), after one warm-up run")
    p.add_argument("--max-model-len", type=int, default=None, help="the served model's context (default: the "
                   "model's; ttft: the longest prompt + 16)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--tokenizer", default=None, help="ttft: the served model's tokenizer directory (default: the "
                   "model's own), for random-weight checkpoints that ship none")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="ttft: dummy draws random weights for a directory holding config.json alone")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--result-file", type=Path, default=None, help="write the JSON here (and the PNG beside it)")


def run(args: argparse.Namespace) -> int:
    result = run_quality(args) if args.mode == "quality" else run_ttft(args)
    report(result, format_summary(result), args.result_file, plot)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return standalone_main("compression", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
