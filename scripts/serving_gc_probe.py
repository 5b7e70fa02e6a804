"""The engine's step-time distribution in a process that holds what `kestrel serve` holds (the server's modules and a
built kestrel-tiny engine), with the garbage collector as CPython sets it, frozen only, or as `kestrel serve` sets
it (kestrel/engine/serving_gc.py).

    python scripts/write_bench_tokenizer.py --out /tmp/tok128k
    python scripts/serving_gc_probe.py --gc as-is|freeze-only|serving --batch 256 --output-len 360

B requests of 128 random tokens decode `--output-len` tokens each over host-step's NullRunner (its forward costs
nothing), twice; the latest four steps' outputs are held, as a server's streams hold them until they are sent.
Prints one JSON line: p50 / p99 / max of the step's wall time in ms and the collector's statistics.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

import kestrel.entrypoints.server  # noqa: F401 - the server's modules on the heap
from kestrel.bench.common import percentile
from kestrel.bench.host_step import NullRunner, _config, _num_blocks
from kestrel.engine.core import EngineCore
from kestrel.engine.serving_gc import tune_for_serving
from kestrel.entrypoints.llm import LLM
from kestrel.loader.tokenizer import load_tokenizer
from kestrel.sampling_params import OUTPUT_KINDS, SamplingParams
from kestrel.tiny import default_model_path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gc", choices=["as-is", "freeze-only", "serving"], required=True)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--output-len", type=int, default=360)
    p.add_argument("--output-kind", choices=OUTPUT_KINDS, default="cumulative")
    p.add_argument("--tokenizer", default="/tmp/tok128k")
    args = p.parse_args()
    held_engine = LLM(str(default_model_path()), dtype="float32")  # a built engine on the heap, as in a server
    tokenizer = load_tokenizer(args.tokenizer)
    shape = argparse.Namespace(batch=args.batch, input_len=128, output_len=args.output_len)
    config = _config("unconstrained", shape)
    if args.gc == "serving":
        tune_for_serving()
    elif args.gc == "freeze-only":
        gc.collect()
        gc.freeze()
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True,
                            output_kind=args.output_kind)
    times = []
    for repeat in range(2):
        runner = NullRunner(len(tokenizer), tokenizer.eos_token_id, seed=repeat)
        core = EngineCore(config, runner, _num_blocks(shape, config), tokenizer, tokenizer.eos_token_id)
        rng = random.Random(repeat)
        for i in range(args.batch):
            core.add_request(f"r{i}", [rng.randrange(1, len(tokenizer)) for _ in range(128)], params)
        held: list[object] = []
        while core.has_unfinished_requests():
            started = time.perf_counter()
            outputs = core.step()
            times.append(1e3 * (time.perf_counter() - started))
            held = [*held[-3:], outputs]
    print(json.dumps({"gc": args.gc, "batch": args.batch, "output_len": args.output_len,
                      "output_kind": args.output_kind, "steps": len(times), "p50_ms": round(percentile(times, 0.5), 3),
                      "p99_ms": round(percentile(times, 0.99), 3), "max_ms": round(max(times), 3),
                      "tracked_objects": len(gc.get_objects()), "frozen_objects": gc.get_freeze_count(),
                      "threshold": gc.get_threshold(), "collections": [g["collections"] for g in gc.get_stats()],
                      "engine_held": held_engine is not None}))


if __name__ == "__main__":
    main()
