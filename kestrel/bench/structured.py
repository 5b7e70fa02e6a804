"""`kestrel bench structured`: the cost of grammar-constrained decoding, and of the step contract's one-token path.

Per batch size, B requests (distinct random prompts, greedy, prefix caching off) decode `--output-len` tokens
unconstrained with the engine's default scheduling (async on a GPU), unconstrained synchronous, and constrained by
each JSON schema of `--schemas` with the default scheduling: under async scheduling step N+1's forward runs while
the host feeds step N's tokens to the grammars and fills N+1's bitmask. Neither schema lets a request complete its
grammar within the run, so every step has all B rows constrained:
- `record`: an object of 100 required fields, strings (at most 12 characters) and one-digit integers, the shape
  of an extraction request; inside a string most of the vocabulary is allowed, so its masks are the costly kind.
- `digit-array`: an array of at least 10,000 digits. xgrammar counts the items of a bounded repetition, and its
  cost to advance a matcher grows with the count (0.48 -> 1.64 ms per 64 tokens over 350 steps on the host
  that develops kestrel), so this one measures a grammar's worst case rather than a typical request.
Reported per mode: the median time of the steps in which all B requests decode; for a constrained one also the
host time filling the bitmask per step and advancing the matchers with the step's tokens.
Overhead = constrained / unconstrained - 1.

Random-weight architectures have no tokenizer: `--tokenizer DIR` gives the vocabulary the grammar is compiled
against (a 128k byte-level BPE is the realistic size: a mask fill scans the vocabulary).
`--smoke` runs a tiny random model on the CPU: a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kestrel.bench import common, register_suite, standalone_main
from kestrel.bench.latency import int_list
from kestrel.config import ConfigError
from kestrel.loader.tokenizer import load_tokenizer
from kestrel.sampling_params import SamplingParams, StructuredOutputsParams
from kestrel.structured.backend import GrammarBackend
from kestrel.structured.shards import grammar_backend

RECORD_FIELDS = 100
SCHEMAS: dict[str, dict[str, Any]] = {
    "record": {"type": "object",
               "properties": {f"f{i}": {"type": "integer", "minimum": 0, "maximum": 9} if i % 2 else
                              {"type": "string", "maxLength": 12} for i in range(RECORD_FIELDS)},
               "required": [f"f{i}" for i in range(RECORD_FIELDS)], "additionalProperties": False},
    "digit-array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 10000},
}
BASE_MODES = ("unconstrained", "unconstrained_sync")


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_model_arguments(p)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    p.add_argument("--batch", default="1,64", help="comma-separated batch sizes")
    p.add_argument("--schemas", default="record,digit-array", help=f"comma-separated, of {sorted(SCHEMAS)}")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--grammar-workers", type=int, default=None,
                   help="processes holding the grammar matchers (the engine's grammar_workers; 0: its thread; "
                        "default: the engine's, half the usable cores up to 8 on a GPU, 0 on the CPU)")
    common.add_report_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.smoke:
        args.batch, args.input_len, args.output_len, args.repeats = "1,2", 8, 6, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    batches = int_list(args.batch)
    schemas = [name for name in args.schemas.split(",") if name]
    unknown = sorted(set(schemas) - set(SCHEMAS))
    if unknown or not schemas:
        raise ConfigError(f"invalid --schemas={args.schemas!r}: unknown {unknown}; use names of {sorted(SCHEMAS)}")
    common.refuse_weight_only(args, "structured")
    model_dir, load_format = common.prepare_model(args.model, args.arch, args.smoke, args.weights_dir, False, device)
    tokenizer_dir = args.tokenizer or model_dir
    if not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        raise ConfigError(f"invalid --tokenizer={tokenizer_dir!r}: no tokenizer.json there; the grammar needs the "
                          "model's vocabulary (pass --tokenizer DIR for a random-weight architecture)")
    engine = common.build_suite_engine(args, model_dir, load_format, device, max(batches),
                                       args.input_len + args.output_len + 1)
    tokenizer = load_tokenizer(tokenizer_dir)
    if args.grammar_workers is not None and args.grammar_workers < 0:
        raise ConfigError(f"invalid --grammar-workers={args.grammar_workers}: expected 0 (the engine's thread) or "
                          "a number of processes")
    backend = grammar_backend(tokenizer, engine.runner.vocab_size, engine.runner.eos_token_ids,
                              args.grammar_workers, max(batches), device.type == "cuda")
    close_engines_own = getattr(engine.core.structured, "close", None)  # its workers, where the engine has some
    if close_engines_own is not None:
        close_engines_own()
    engine.core.structured = backend
    default_async = engine.core.async_scheduling
    vocab = min(common.prompt_vocab(model_dir), tokenizer.vocab_size)
    rows = []
    result: dict[str, Any] = {
        "suite": "structured",
        "config": {**common.engine_config_block(args, engine, model_dir, load_format), "batches": batches,
                   "input_len": args.input_len, "output_len": args.output_len, "repeats": args.repeats,
                   "grammar_workers": backend.worker_count,
                   "tokenizer": tokenizer_dir, "tokenizer_vocab": len(tokenizer),
                   "schemas": {name: SCHEMAS[name] for name in schemas}},
        "environment": common.environment(device), "rows": rows, "complete": False,
    }
    for batch in batches:
        row: dict[str, Any] = {"batch": batch}
        for mode in (*BASE_MODES, *schemas):
            engine.core.async_scheduling = False if mode == "unconstrained_sync" else default_async
            samples = [measure(engine, backend, batch, args, vocab, mode, f"{mode}-{batch}-{r}")
                       for r in range(args.repeats + 1)][1:]  # the first run warms up (graphs, compiled grammar)
            row[f"{mode}_ms_per_step"] = statistics.median(s["step_ms"] for s in samples)
            if mode in SCHEMAS:
                row[f"{mode}_mask_fill_ms_per_step"] = statistics.median(s["fill_ms"] for s in samples)
                row[f"{mode}_accept_ms_per_step"] = statistics.median(s["accept_ms"] for s in samples)
                row[f"{mode}_overhead_vs_default"] = row[f"{mode}_ms_per_step"] / row["unconstrained_ms_per_step"] - 1
                row[f"{mode}_overhead_vs_sync"] = (row[f"{mode}_ms_per_step"]
                                                   / row["unconstrained_sync_ms_per_step"] - 1)
        engine.core.async_scheduling = default_async
        rows.append(row)
        common.log(f"batch {batch}: {row}")
        common.write_result(result, args.result_file, quiet=True)
    result["complete"] = True
    common.report(result, summary(result), args.result_file, plot)
    common.release(engine)
    return 0


def add_requests(core: Any, mode: str, batch: int, args: argparse.Namespace, vocab: int, tag: str) -> None:
    """`batch` greedy requests of random prompts, constrained by the schema `mode` names (else unconstrained), their
    ids `{tag}-{i}`, each decoding `--output-len` tokens."""
    spec = StructuredOutputsParams(json=SCHEMAS[mode], disable_any_whitespace=True) if mode in SCHEMAS else None
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True, structured_outputs=spec)
    g = torch.Generator().manual_seed(hash(tag) % (1 << 31))
    for i in range(batch):
        core.add_request(f"{tag}-{i}", torch.randint(1, vocab, (args.input_len,), generator=g).tolist(), params)


def measure(engine: common.Engine, backend: GrammarBackend, batch: int, args: argparse.Namespace, vocab: int,
            mode: str, tag: str) -> dict[str, float]:
    core = engine.core
    add_requests(core, mode, batch, args, vocab, tag)
    fills_before = backend.num_fills
    steps: list[float] = []
    first: set[str] = set()
    before = time.perf_counter()
    decode_fills = decode_fill_s = decode_accept_s = 0.0
    while core.has_unfinished_requests():
        decoding = len(first) == batch
        n, s, a = backend.num_fills, backend.fill_seconds, backend.accept_seconds
        outputs = core.step()
        after = time.perf_counter()
        if decoding:
            steps.append(after - before)
            decode_fills += backend.num_fills - n
            decode_fill_s += backend.fill_seconds - s
            decode_accept_s += backend.accept_seconds - a
        before = after
        first.update(o.request_id for o in outputs if o.outputs[0].token_ids)
    produced = backend.num_fills - fills_before
    if mode in SCHEMAS and produced == 0:
        raise RuntimeError("the constrained run filled no bitmask")
    return {"step_ms": 1e3 * statistics.median(steps),
            "fill_ms": 1e3 * decode_fill_s / decode_fills if decode_fills else 0.0,
            "accept_ms": 1e3 * decode_accept_s / decode_fills if decode_fills else 0.0}


def summary(result: dict[str, Any]) -> str:
    lines = ["batch  schema        default ms/step  sync ms/step  constrained ms/step  mask fill ms  accept ms  "
             "overhead (vs default, vs sync)"]
    for r in result["rows"]:
        for name in SCHEMAS:
            if f"{name}_ms_per_step" not in r:
                continue
            lines.append(f"{r['batch']:>5}  {name:<12}  {r['unconstrained_ms_per_step']:>15.3f}"
                         f"  {r['unconstrained_sync_ms_per_step']:>12.3f}  {r[f'{name}_ms_per_step']:>19.3f}"
                         f"  {r[f'{name}_mask_fill_ms_per_step']:>12.3f}  {r[f'{name}_accept_ms_per_step']:>9.3f}"
                         f"  {100 * r[f'{name}_overhead_vs_default']:+.1f}%,"
                         f" {100 * r[f'{name}_overhead_vs_sync']:+.1f}%")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    rows = result["rows"]
    schemas = [name for name in SCHEMAS if rows and f"{name}_ms_per_step" in rows[0]]
    modes = [*BASE_MODES, *schemas]
    labels = ["unconstrained (default)", "unconstrained, sync", *(f"JSON schema: {name}" for name in schemas)]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(modes)
    for k, (mode, label) in enumerate(zip(modes, labels)):
        xs = [i + (k - (len(modes) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [r[f"{mode}_ms_per_step"] for r in rows], width, label=label)
        if mode in SCHEMAS:
            ax.bar(xs, [r[f"{mode}_mask_fill_ms_per_step"] + r[f"{mode}_accept_ms_per_step"] for r in rows],
                   width * 0.4, color="black")
    ax.set_xticks(range(len(rows)), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("ms per decode step (black: host grammar work, overlapped)")
    ax.set_title(f"structured outputs cost ({result['environment'].get('device', '')})", fontsize=9)
    ax.legend(fontsize=8)
    return common.save_figure(plt, fig, path)


def register(subparsers) -> argparse.ArgumentParser:
    return register_suite(subparsers, "structured", "grammar-constrained decoding cost per step", add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    return standalone_main("structured", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
