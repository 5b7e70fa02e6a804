"""Host time of `build_model_inputs` for a decode step (the runner's per-step input building, on the CPU): every
request decodes one token whose id is still in flight (async scheduling), prompt 128, 100 tokens generated.

    python scripts/model_inputs_host_time.py --batch 64,256 [--repeats 300] [--out FILE.json]

Run it from the tree to measure (the package is taken from the working directory).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kestrel.sampling_params import SamplingParams
from kestrel.worker.input_batch import BlockTables, CachedRequestState, build_model_inputs

BLOCK_SIZE = 16


def decode_batch(batch: int, num_tokens: int) -> tuple[list[CachedRequestState], BlockTables]:
    tables = BlockTables(batch, 512)
    states = []
    for i in range(batch):
        blocks = list(range(i * 64, i * 64 + num_tokens // BLOCK_SIZE + 1))
        row = tables.add([blocks])
        states.append(CachedRequestState(f"r{i}", list(range(num_tokens)), 128, SamplingParams(), [blocks], num_tokens,
                                         block_table_row=row, num_pending=1, pending_row=i))
    return states, tables


def measure(batch: int, repeats: int) -> dict[str, float]:
    states, tables = decode_batch(batch, 228)
    last_sampled = torch.zeros(batch, dtype=torch.int64)
    counts = [1] * batch
    cpu = torch.device("cpu")
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        build_model_inputs(states, counts, BLOCK_SIZE, cpu, tables, last_sampled)
        times.append(time.thread_time() - start)
    return {"batch": batch, "median_ms": round(1e3 * statistics.median(times), 4),
            "min_ms": round(1e3 * min(times), 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="64,256")
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = [measure(int(b), args.repeats) for b in args.batch.split(",")]
    for row in rows:
        print(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"what": "build_model_inputs host time, decode step, thread CPU time", "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
