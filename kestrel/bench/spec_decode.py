"""`kestrel bench spec-decode`: what speculative decoding buys at batch 1, and what verification costs.

Part 1, n-gram on kestrel-tiny: code-completion prompts cut from the held-out corpus (the first `--prompt-len`
tokens of each file) decode `--output-len` greedy tokens one request at a time, without speculation and with
n-gram proposals of k = each of `--k`; reported per k: output tokens/s, the speedup, the mean accepted length
(tokens per verify step, the sampled one included), the acceptance rate and the acceptance by draft position.
Greedy outputs are compared with the run without speculation (they must be equal).

Part 1b, the same prompts with a draft model (`--draft-model DIR`) and an EAGLE-style head (`--eagle-head DIR`) for
kestrel-tiny (scripts/train_eagle_tiny.py trains both), at each k of `--model-k`: the same columns.

Part 2, verification cost on the Llama-3-8B architecture (random weights): at batch 1 with a 512-token context,
the time of a decode step that verifies k drafts (a (k + 1)-token forward, drafts fixed and mostly rejected)
against a one-token step, for k = 1..8, both replayed in CUDA graphs (the engine captures the verify shapes);
speculation pays when the accepted length exceeds that ratio.

`--smoke` runs a tiny random model on the CPU (kestrel-tiny drafting for itself, a random head): a check of the
script, not a measurement.
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
from kestrel.sampling_params import SamplingParams
from kestrel.tiny import corpus, default_model_path

METHODS = ("ngram", "draft_model", "eagle")


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_model_arguments(p)  # the model and engine of part 2 (part 1 runs the bundled kestrel-tiny)
    p.add_argument("--k", default="1,2,4,6", help="comma-separated numbers of speculative tokens (part 1)")
    p.add_argument("--prompts", type=int, default=8, help="held-out files to complete (part 1)")
    p.add_argument("--prompt-len", type=int, default=200)  # + output-len + 8 within the 512 context
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--draft-model", type=Path, default=None, help="a draft model for kestrel-tiny (part 1b)")
    p.add_argument("--eagle-head", type=Path, default=None, help="an EAGLE-style head for kestrel-tiny (part 1b)")
    p.add_argument("--model-k", default="2,4", help="num_speculative_tokens of the draft model and the head")
    p.add_argument("--verify-k", default="1,2,3,4,5,6,7,8", help="draft counts of the cost sweep (part 2)")
    p.add_argument("--skip-verify-sweep", action="store_true")
    p.add_argument("--skip-ngram", action="store_true", help="part 1b only: the baseline, draft model and head")
    common.add_report_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.smoke:
        args.k, args.prompts, args.prompt_len, args.output_len, args.verify_k = "2", 1, 32, 10, "1,2"
        args.model_k = "2"
        smoke_proposers(args)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    result: dict[str, Any] = {"suite": "spec-decode", "environment": common.environment(device),
                              "config": {"k": int_list(args.k), "prompts": args.prompts, "prompt_len": args.prompt_len,
                                         "output_len": args.output_len, "smoke": args.smoke},
                              "ngram": [], "draft_model": [], "eagle": [], "verify_cost": [], "complete": False}
    ngram_part(args, device, result)
    common.write_result(result, args.result_file, quiet=True)
    if not args.skip_verify_sweep:
        verify_part(args, device, result)
    result["complete"] = True
    common.report(result, summary(result), args.result_file, plot)
    return 0


def _prompts(tokenizer: Any, count: int, length: int) -> list[list[int]]:
    files = corpus.select_evenly(corpus.eval_files(), count * 3)
    prompts = []
    for text in corpus.texts(files):
        ids = tokenizer(text).input_ids
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == count:
            break
    return prompts


def ngram_part(args: argparse.Namespace, device: torch.device, result: dict[str, Any]) -> None:
    model = str(default_model_path())
    engine_args = {"dtype": "float32" if device.type == "cpu" else "bfloat16", "device": device.type,
                   "max_model_len": args.prompt_len + args.output_len + 8, "enable_prefix_caching": False,
                   "max_num_seqs": 1}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    engine = common.build_engine(model, **engine_args)
    prompts = _prompts(engine.core.tokenizer, args.prompts, args.prompt_len)
    baseline, baseline_s = _decode_each(engine, prompts, params)
    common.release(engine)
    base_tps = len(prompts) * args.output_len / baseline_s
    result["ngram_baseline_tok_s"] = result["baseline_tok_s"] = base_tps
    runs = [] if args.skip_ngram else [("ngram", {"method": "ngram"}, k) for k in int_list(args.k)]
    for method, path in (("draft_model", args.draft_model), ("eagle", args.eagle_head)):
        if path is not None:
            runs += [(method, {"method": method, "model": str(path)}, k) for k in int_list(args.model_k)]
    for method, spec, k in runs:
        engine = common.build_engine(model, **engine_args, speculative_config={**spec, "num_speculative_tokens": k})
        outputs, seconds = _decode_each(engine, prompts, params)
        stats = engine.core.scheduler.stats
        steps = stats.num_spec_drafts
        tps = len(prompts) * args.output_len / seconds
        row = {"k": k, "tok_s": tps, "speedup": tps / base_tps,
               "mean_accepted_length": (stats.num_spec_accepted_tokens + steps) / steps if steps else 1.0,
               "acceptance_rate": stats.num_spec_accepted_tokens / max(stats.num_spec_draft_tokens, 1),
               "accepted_per_position": [a / steps for a in stats.spec_accepted_per_position] if steps else [],
               "verify_steps": steps, "identical_to_baseline": outputs == baseline}
        result[method].append(row)
        common.log(f"{method} k={k}: {row}")
        common.release(engine)


def smoke_proposers(args: argparse.Namespace) -> None:
    """Proposers for a CPU check of part 1b when none are given: kestrel-tiny as its own draft, a random head."""
    import json

    from kestrel.loader.model_init import write_eagle_head

    tiny = default_model_path()
    if args.draft_model is None:
        args.draft_model = tiny
    if args.eagle_head is None:
        head = common.temporary_dir("kestrel-smoke-eagle-")
        write_eagle_head(head, json.loads((tiny / "config.json").read_text()), seed=0)
        args.eagle_head = head


def _decode_each(engine: common.Engine, prompts: list[list[int]],
                 params: SamplingParams) -> tuple[list[list[int]], float]:
    """Batch 1: each prompt alone (after one warm-up), timed end to end."""
    _generate(engine, prompts[0], params.replace(max_tokens=8), "warm-up")
    outputs, seconds = [], 0.0
    for i, prompt in enumerate(prompts):
        common.synchronize(engine.runner.device)
        started = time.perf_counter()
        outputs.append(_generate(engine, prompt, params, f"p{i}"))
        common.synchronize(engine.runner.device)
        seconds += time.perf_counter() - started
    return outputs, seconds


def _generate(engine: common.Engine, prompt: list[int], params: SamplingParams, request_id: str) -> list[int]:
    core = engine.core
    core.add_request(request_id, prompt, params)
    tokens: list[int] = []
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
    return tokens


def verify_part(args: argparse.Namespace, device: torch.device, result: dict[str, Any]) -> None:
    """Steps with k fixed drafts vs plain decode steps, on the --arch model."""
    common.refuse_weight_only(args, "spec-decode")
    model_dir, load_format = common.prepare_model(args.model, args.arch, args.smoke, args.weights_dir, False, device)
    context = 512 if not args.smoke else 32
    ks = int_list(args.verify_k)
    if device.type != "cuda":
        args.dtype = "float32"
    engine = common.build_suite_engine(args, model_dir, load_format, device, 1, context + 64 + max(ks) + 2,
                                       speculative_config={"method": "ngram", "num_speculative_tokens": max(ks)})
    core = engine.core
    vocab = common.prompt_vocab(model_dir)
    prompt = torch.randint(1, vocab, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    times: dict[int, float] = {}
    for k in [0, *ks]:
        fixed = [3] * k

        def propose(drafts: list[int] = fixed) -> None:  # a fixed proposal (random weights reject it)
            for request in core.scheduler.running:
                request.spec_token_ids = list(drafts)

        core._propose_drafts = propose  # the bench's own proposer: fixed drafts of length k
        core.add_request(f"verify-{k}", prompt, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
        core.step()  # the prompt's step
        steps = []
        before = time.perf_counter()
        while core.has_unfinished_requests():
            core.step()
            after = time.perf_counter()
            steps.append(after - before)
            before = after
        times[k] = statistics.median(steps)
    for k in ks:
        result["verify_cost"].append({"k": k, "step_ms": 1e3 * times[k], "plain_step_ms": 1e3 * times[0],
                                      "ratio": times[k] / times[0]})
    common.release(engine)


def summary(result: dict[str, Any]) -> str:
    lines = [f"kestrel-tiny, batch 1: baseline {result.get('ngram_baseline_tok_s', 0):.1f} tok/s"]
    for method in METHODS:
        for r in result.get(method, []):
            lines.append(f"  {method} k={r['k']}: {r['tok_s']:.1f} tok/s ({r['speedup']:.2f}x), mean accepted length "
                         f"{r['mean_accepted_length']:.2f}, acceptance {100 * r['acceptance_rate']:.0f}%, identical "
                         f"{r['identical_to_baseline']}")
    for r in result["verify_cost"]:
        lines.append(f"  verify k={r['k']}: {r['step_ms']:.2f} ms vs {r['plain_step_ms']:.2f} ms ({r['ratio']:.2f}x)")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for method, color in zip(METHODS, ("C0", "C1", "C2")):
        rows = result.get(method, [])
        if not rows:
            continue
        ks = [r["k"] for r in rows]
        left.plot(ks, [r["speedup"] for r in rows], "o-", color=color, label=f"{method}: speedup (tok/s)")
        left.plot(ks, [r["mean_accepted_length"] for r in rows], "s--", color=color,
                  label=f"{method}: mean accepted length")
    left.axhline(1.0, color="gray", lw=0.5)
    left.set_xlabel("num_speculative_tokens")
    left.set_title("kestrel-tiny, batch 1", fontsize=9)
    left.legend(fontsize=8)
    if result["verify_cost"]:
        right.plot([r["k"] for r in result["verify_cost"]], [r["ratio"] for r in result["verify_cost"]], "o-")
        right.set_xlabel("drafts verified (k)")
        right.set_ylabel("step time / one-token step")
        right.set_title("verification cost, Llama-3-8B shape, batch 1", fontsize=9)
    return common.save_figure(plt, fig, path)


def register(subparsers) -> argparse.ArgumentParser:
    return register_suite(subparsers, "spec-decode", "speculative decoding: speedup, acceptance, verify cost",
                          add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    return standalone_main("spec-decode", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
