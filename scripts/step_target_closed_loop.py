"""The step time target (`--step-time-target-ms`) in the engine, without HTTP: a closed loop of `--streams` requests
(each finished one replaced at once, as `kestrel bench serve --concurrency` keeps them), random prompts of
`--input-len` tokens and `--output-len` output tokens, EOS ignored, per target in `--targets` ("off" or ms), each in
an engine of its own. A token's arrival is the return of the engine step that hands it out, so ITL here is the
engine's own spacing of a request's tokens (the server adds its HTTP path on top). Writes OUT/step-target-<gpu>.json.

    PYTHONPATH=$PWD python scripts/step_target_closed_loop.py --out OUT --quantization fp8 --kv-cache-dtype fp8 \\
        --targets off,30
    python scripts/step_target_closed_loop.py --out OUT --smoke   # kestrel-tiny's shape on the CPU: a check
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from kestrel.bench import common
from kestrel.bench.common import percentile
from kestrel.kernels.common import device_name, gpu_key
from kestrel.sampling_params import SamplingParams


def closed_loop(engine: common.Engine, streams: int, num_requests: int, warmup: int, input_len: int,
                output_len: int, vocab: int, seed: int) -> dict:
    core = engine.core
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, output_kind="delta")
    sent: dict[str, float] = {}
    arrivals: dict[str, list[float]] = {}
    started = finished = 0
    total = warmup + num_requests

    def send() -> None:
        nonlocal started
        rid = f"r{started}"
        started += 1
        core.add_request(rid, [rng.randrange(10, vocab) for _ in range(input_len)], params)
        sent[rid] = time.perf_counter()
        arrivals[rid] = []

    for _ in range(min(streams, total)):
        send()
    measured_from = None
    steps = 0
    while core.has_unfinished_requests():
        outputs = core.step()
        now = time.perf_counter()
        steps += 1
        for out in outputs:
            if out.outputs and out.outputs[0].delta_token_ids:
                arrivals[out.request_id].extend([now] * len(out.outputs[0].delta_token_ids))
            if out.finished:
                finished += 1
                if finished == warmup:
                    measured_from = now
                if started < total:
                    send()
    ended = time.perf_counter()
    measured = [rid for rid in arrivals if int(rid[1:]) >= warmup]
    ttft = [1e3 * (arrivals[rid][0] - sent[rid]) for rid in measured]
    itl = [1e3 * (b - a) for rid in measured for a, b in zip(arrivals[rid], arrivals[rid][1:])]
    tpot = [1e3 * (arrivals[rid][-1] - arrivals[rid][0]) / (len(arrivals[rid]) - 1) for rid in measured]
    elapsed = ended - (measured_from or sent["r0"])
    return {"requests": len(measured), "steps": steps, "out_tok_per_s": len(measured) * output_len / elapsed,
            "ttft_ms": {"mean": statistics.fmean(ttft), "p50": percentile(ttft, 0.5), "p99": percentile(ttft, 0.99)},
            "itl_ms": {"mean": statistics.fmean(itl), "p50": percentile(itl, 0.5), "p90": percentile(itl, 0.9),
                       "p99": percentile(itl, 0.99), "max": max(itl)},
            "tpot_ms_mean": statistics.fmean(tpot)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--arch", default="llama3-8b")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--targets", default="off,30", help="comma list of ms or 'off'")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=200)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--engine-args", default="{}", help='more engine arguments as JSON, e.g. '
                        '\'{"max_prefill_graph_tokens": 1024}\'')
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:  # a check of the script, unless the sizes are given
        defaults = parser.parse_args(["--out", args.out])
        for name, small in (("streams", 4), ("num_requests", 8), ("warmup", 2), ("input_len", 64), ("output_len", 8)):
            if getattr(args, name) == getattr(defaults, name):
                setattr(args, name, small)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    model_dir, load_format = common.prepare_model(None, args.arch, args.smoke, None, False, device)
    gpu = gpu_key(device_name(0)) if device.type == "cuda" else "cpu"
    results = {"gpu": gpu, "args": vars(args), "runs": []}
    out_file = Path(args.out) / f"step-target-{gpu}.json"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for target in args.targets.split(","):
        engine_args = {"load_format": load_format, "max_num_seqs": args.max_num_seqs,
                       "max_num_batched_tokens": args.max_num_batched_tokens,
                       "max_model_len": args.input_len + args.output_len + 16,
                       "step_time_target_ms": None if target == "off" else float(target)}
        engine_args.update(json.loads(args.engine_args))
        if args.async_scheduling != "auto":
            engine_args["async_scheduling"] = args.async_scheduling == "on"
        if args.quantization:
            engine_args["quantization"] = args.quantization
        if args.kv_cache_dtype != "auto":
            engine_args["kv_cache_dtype"] = args.kv_cache_dtype
        engine = common.build_engine(model_dir, **engine_args)
        vocab = engine.config.model.hf_config.get("vocab_size", 1000)
        run = {"target_ms": target, **closed_loop(engine, args.streams, args.num_requests, args.warmup,
                                                   args.input_len, args.output_len, vocab, seed=0)}
        scheduler = engine.core.scheduler
        run["fit"] = scheduler.step_cost.fit() if scheduler.step_cost is not None else None
        print(json.dumps(run), flush=True)
        results["runs"].append(run)
        out_file.write_text(json.dumps(results, indent=1))
        common.release(engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
