"""`kestrel bench ppl`: perplexity and bits per byte on the held-out stdlib files, from kestrel's prompt logprobs.

Each held-out file is one document: `<bos>` followed by its tokens; every file token is scored given the
tokens before it (the bos token itself is context, never scored). A document longer than the engine
allows is cut into windows of W = max_model_len - 1 tokens (the engine keeps one slot of the context
for the token it generates) that start every S = --stride tokens (default W // 2). The first window
scores all its tokens; each later window scores only the tokens past the previous window's end, so
every token is scored exactly once and, after the first window, with at least W - S tokens of context.

Totals: NLL = sum over scored tokens of -ln p(token | context); perplexity = exp(NLL / tokens);
bits per byte = NLL / ln 2 / UTF-8 bytes of the scored files (the whole files, since every file token is
scored). The unigram baseline scores the same tokens with token frequencies counted on the train
split, add-one smoothed over the model's vocabulary, with the same accounting.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from kestrel.bench import register_suite, standalone_main
from kestrel.bench.common import write_result
from kestrel.config import ConfigError, EngineConfig
from kestrel.engine.core import EngineCore
from kestrel.loader.gguf_config import model_hf_config
from kestrel.loader.tokenizer import load_tokenizer
from kestrel.outputs import PromptLogprobs
from kestrel.sampling_params import SamplingParams
from kestrel.tiny import corpus, default_model_path
from kestrel.worker.model_runner import ModelRunner

ENCODE_BATCH = 64


@dataclass(frozen=True)
class Document:
    name: str
    token_ids: list[int]  # separator (bos) first, then the file's tokens
    num_bytes: int

    @property
    def num_scored(self) -> int:
        return len(self.token_ids) - 1


@dataclass(frozen=True)
class Window:
    doc: int
    begin: int
    end: int
    score_from: int  # absolute position of the first scored token; begin < score_from < end


def plan_windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, score_from) spans covering positions 1..num_tokens-1, each scored exactly once."""
    if not 1 <= stride < window:
        raise ConfigError(f"invalid stride={stride}: expected 1 <= stride < window={window}")
    spans: list[tuple[int, int, int]] = []
    begin, scored_to = 0, 1
    while scored_to < num_tokens:
        end = min(begin + window, num_tokens)
        spans.append((begin, end, scored_to))
        scored_to = end
        begin += stride
    return spans


def separator_id(tokenizer: Any) -> int:
    token_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if token_id is None:
        raise ConfigError("the tokenizer has neither a bos nor an eos token to start each document with")
    return int(token_id)


def encode_texts(tokenizer: Any, texts: Sequence[str], desc: str | None = None) -> list[list[int]]:
    """Token ids of each text, without special tokens (batched; a progress bar when desc is given)."""
    out: list[list[int]] = []
    bar = tqdm(total=len(texts), desc=desc, unit="file", disable=desc is None)
    for start in range(0, len(texts), ENCODE_BATCH):
        batch = list(texts[start: start + ENCODE_BATCH])
        out.extend(tokenizer(batch, add_special_tokens=False)["input_ids"])
        bar.update(len(batch))
    bar.close()
    return out


def load_documents(tokenizer: Any, files: list[corpus.SourceFile]) -> list[Document]:
    pairs = list(corpus.iter_texts(files))
    separator = separator_id(tokenizer)
    encoded = encode_texts(tokenizer, [text for _, text in pairs])
    return [Document(f.rel, [separator, *ids], len(text.encode("utf-8")))
            for (f, text), ids in zip(pairs, encoded) if ids]


def make_windows(documents: list[Document], window: int, stride: int) -> list[Window]:
    return [Window(i, b, e, s) for i, doc in enumerate(documents)
            for b, e, s in plan_windows(len(doc.token_ids), window, stride)]


# ------------------------------------------------------------------------------------------------ scorers


class KestrelScorer:
    """Prompt logprobs from kestrel's engine: one request per window, max_tokens=1."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.config = EngineConfig.from_kwargs(model, hf_config=model_hf_config(model), **engine_args)
        self.tokenizer = load_tokenizer(self.config.model.tokenizer_path)
        eos = self.tokenizer.eos_token_id
        self.runner = ModelRunner(self.config, eos_token_id=eos)
        self.engine = EngineCore(self.config, self.runner, self.runner.kv_layout, self.tokenizer, eos)
        self.vocab_size = self.runner.vocab_size
        self.max_model_len = self.config.model.max_model_len or 0

    def window_nll(self, documents: list[Document], windows: list[Window], use_tqdm: bool = True) -> list[float]:
        """Summed NLL (nats) of each window's scored tokens, in window order."""
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
        in_flight_limit = 2 * self.config.scheduler.max_num_seqs
        results: list[float] = [0.0] * len(windows)
        bar = tqdm(total=sum(w.end - w.score_from for w in windows), desc="ppl", unit="tok", disable=not use_tqdm)
        pending = iter(range(len(windows)))
        in_flight = 0
        exhausted = False
        try:
            while True:
                while not exhausted and in_flight < in_flight_limit:
                    index = next(pending, None)
                    if index is None:
                        exhausted = True
                        break
                    w = windows[index]
                    self.engine.add_request(str(index), documents[w.doc].token_ids[w.begin: w.end], params)
                    in_flight += 1
                if in_flight == 0:
                    break
                for output in self.engine.step():
                    if not output.finished:
                        continue
                    index = int(output.request_id)
                    results[index] = _scored_nll(windows[index], documents[windows[index].doc],
                                                 output.prompt_logprobs)
                    in_flight -= 1
                    bar.update(windows[index].end - windows[index].score_from)
        finally:
            bar.close()
        return results


def _scored_nll(w: Window, doc: Document, prompt_logprobs: PromptLogprobs | None) -> float:
    if prompt_logprobs is None or len(prompt_logprobs) != w.end - w.begin:
        raise RuntimeError(f"window {w} of {doc.name}: expected {w.end - w.begin} prompt logprobs, got "
                           f"{None if prompt_logprobs is None else len(prompt_logprobs)}")
    total = 0.0
    for pos in range(w.score_from, w.end):
        entry = prompt_logprobs[pos - w.begin]
        assert entry is not None
        total -= entry[doc.token_ids[pos]].logprob
    return total


def unigram_counts(tokenizer: Any, texts: Sequence[str], use_tqdm: bool = True) -> dict[int, int]:
    counts: dict[int, int] = {}
    for ids in encode_texts(tokenizer, texts, desc="unigram counts" if use_tqdm else None):
        for token_id in ids:
            counts[token_id] = counts.get(token_id, 0) + 1
    return counts


def unigram_doc_nll(counts: dict[int, int], vocab_size: int, doc: Document) -> float:
    """Add-one smoothed unigram NLL (nats) of the document's scored tokens."""
    log_total = math.log(sum(counts.values()) + vocab_size)
    return sum(log_total - math.log(counts.get(t, 0) + 1) for t in doc.token_ids[1:])


# ------------------------------------------------------------------------------------------------ reporting


def summarize(nll: float, tokens: int, num_bytes: int) -> dict[str, float]:
    return {"nll": nll, "perplexity": math.exp(nll / tokens), "bits_per_token": nll / math.log(2) / tokens,
            "bits_per_byte": nll / math.log(2) / num_bytes}


def evaluate(scorer: KestrelScorer, documents: list[Document], stride: int | None, counts: dict[int, int],
             use_tqdm: bool = True) -> dict[str, Any]:
    """Model and unigram totals plus per-file numbers for the given documents."""
    window = scorer.max_model_len - 1
    stride = stride if stride is not None else window // 2
    windows = make_windows(documents, window, stride)
    window_nll = scorer.window_nll(documents, windows, use_tqdm=use_tqdm)
    per_doc = [0.0] * len(documents)
    for w, nll in zip(windows, window_nll):
        per_doc[w.doc] += nll
    uni = [unigram_doc_nll(counts, scorer.vocab_size, doc) for doc in documents]
    tokens = sum(d.num_scored for d in documents)
    num_bytes = sum(d.num_bytes for d in documents)
    model = summarize(sum(per_doc), tokens, num_bytes)
    baseline = summarize(sum(uni), tokens, num_bytes)
    return {
        "window": window, "stride": stride, "num_windows": len(windows), "files": len(documents),
        "tokens": tokens, "bytes": num_bytes, "model": model, "unigram": baseline,
        "bits_per_byte_ratio": model["bits_per_byte"] / baseline["bits_per_byte"],
        "per_file": [{"path": d.name, "tokens": d.num_scored, "bytes": d.num_bytes, "nll": n, "unigram_nll": u}
                     for d, n, u in zip(documents, per_doc, uni)],
    }


def register(subparsers) -> argparse.ArgumentParser:
    return register_suite(subparsers, "ppl", "held-out perplexity and bits per byte (stdlib corpus) vs a unigram",
                          add_arguments, run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: the bundled kestrel-tiny)")
    p.add_argument("--max-files", type=int, default=None, help="score this many held-out files (evenly spread)")
    p.add_argument("--max-model-len", type=int, default=None, help="context per window (default: the model's)")
    p.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: window // 2)")
    p.add_argument("--baseline-files", type=int, default=None,
                   help="count unigram frequencies on this many train files (default: the whole train split)")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16 or auto")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--result-file", type=Path, default=None, help="write the JSON result here")
    p.add_argument("--quant-sweep", action="store_true",
                   help="score the float model and each quantization (kestrel quantize) on kestrel-tiny and an "
                        "outlier-injected copy; JSON + bar chart (see kestrel.bench.quant_accuracy)")
    p.add_argument("--calibration-samples", type=int, default=32, help="256-token calibration sequences (sweep)")
    p.add_argument("--variants", default=None,
                   help="with --quant-sweep: comma-separated variants to score besides the float model (default: all; "
                        "see kestrel.bench.quant_accuracy.VARIANTS)")


def run(args: argparse.Namespace) -> int:
    if args.quant_sweep:
        return _run_quant_sweep(args)
    if args.variants is not None:
        raise ConfigError("--variants selects the variants of --quant-sweep; pass --quant-sweep with it")
    started = time.perf_counter()
    model = args.model or str(default_model_path())
    scorer = _scorer(args, model)
    documents = _held_out_documents(args, scorer.tokenizer)
    train_set = corpus.select_evenly(corpus.train_files(), args.baseline_files)
    counts = unigram_counts(scorer.tokenizer, corpus.texts(train_set))
    result = {
        "suite": "ppl", "model_dir": model, "dtype": args.dtype, "device": str(scorer.runner.device),
        "python": platform.python_version(), "stdlib": str(corpus.stdlib_root()),
        "baseline_train_files": len(train_set), "baseline_train_tokens": sum(counts.values()),
        **evaluate(scorer, documents, args.stride, counts),
    }
    result["seconds"] = round(time.perf_counter() - started, 2)
    print(format_summary(result))
    write_result(result, args.result_file)
    return 0


def _scorer(args: argparse.Namespace, model: str, **engine_args: Any) -> KestrelScorer:
    return KestrelScorer(model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                         max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                         **engine_args)


def _held_out_documents(args: argparse.Namespace, tokenizer: Any) -> list[Document]:
    eval_set = corpus.select_evenly([f for f in corpus.eval_files() if f.path.stat().st_size > 0], args.max_files)
    documents = load_documents(tokenizer, eval_set)
    if not documents:
        raise ConfigError(f"no held-out files to score under {corpus.stdlib_root()}")
    return documents


def _run_quant_sweep(args: argparse.Namespace) -> int:
    from kestrel.bench import quant_accuracy

    quant_accuracy.selected_variants(args.variants)  # a bad name fails before anything loads
    tokenizer = load_tokenizer(args.model or str(default_model_path()))
    documents = _held_out_documents(args, tokenizer)
    counts = unigram_counts(tokenizer, corpus.texts(corpus.select_evenly(corpus.train_files(), args.baseline_files)),
                            use_tqdm=False)

    def score(model_dir: str, calibrate_kv: list[list[int]] | None = None, **engine_args: Any) -> dict[str, Any]:
        scorer = _scorer(args, model_dir, **engine_args)
        if calibrate_kv is not None:
            scorer.runner.calibrate_kv_scales([t for sample in calibrate_kv for t in sample])
        result = evaluate(scorer, documents, args.stride, counts, use_tqdm=False)
        if engine_args.get("kv_cache_dtype") == "fp8":
            result["kv_scales"] = [list(s) for s in scorer.runner.kv_scales]
        return result

    result = quant_accuracy.run_sweep(args, score, tokenizer)
    result.update(files=len(documents), tokens=sum(d.num_scored for d in documents), dtype=args.dtype)
    for row in result["rows"]:
        row.pop("files", None)
    for t in result["targets"]:
        print(f"{'PASS' if t['pass'] else 'FAIL'}  {t['target']}: {t['measured']}")
    write_result(result, args.result_file)
    if args.result_file is not None and quant_accuracy.plot(result, args.result_file.with_suffix(".png")):
        print(f"wrote {args.result_file.with_suffix('.png')}")
    return 0


def format_summary(result: dict[str, Any]) -> str:
    lines = [f"{result['files']} held-out files, {result['tokens']:,} tokens, {result['bytes']:,} bytes "
             f"(window {result['window']}, stride {result['stride']}, Python {result['python']})",
             f"{'':10}{'perplexity':>12}{'bits/token':>12}{'bits/byte':>11}"]
    for name in ("model", "unigram"):
        r = result[name]
        lines.append(f"{name:10}{r['perplexity']:12.3f}{r['bits_per_token']:12.4f}{r['bits_per_byte']:11.4f}")
    lines.append(f"model / unigram bits per byte: {result['bits_per_byte_ratio']:.3f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return standalone_main("ppl", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
