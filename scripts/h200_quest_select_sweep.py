"""Quest's page selection (`quest_select`: streamed page scores, then the radix top-k) over launch shapes
(`StreamConfig`: pages a tile, programs per SM, warps, loop stages, selection warps) on one GPU at the 8B shape
(32 / 8 heads of 128, blocks of 16), context 32k, budget 2048, batch 1, 8, 32, BF16 and FP8 caches. Each shape is
checked to select exactly what the default shape selects, then timed as CUDA-graph replays
(`kestrel.bench.timing.time_calls`, median), beside the sparse attention over that selection. Writes
OUT/quest-select-sweep-h200.json after every point.

    PYTHONPATH=. python scripts/h200_quest_select_sweep.py --out OUT                   # the H200 run, about 1 minute
    TRITON_INTERPRET=1 PYTHONPATH=. python scripts/h200_quest_select_sweep.py --out OUT --smoke   # CPU check
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel.bench.timing import sweep_script_args, time_calls  # noqa: E402
from kestrel.kernels import sparse_decode as sd  # noqa: E402

BLOCK = 16
HEADS, KV_HEADS, DIM = 32, 8, 128
FP8 = torch.float8_e4m3fn


def cache(batch: int, context: int, cache_dtype: torch.dtype, device: torch.device, seed: int) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq
    scale = 1 / 64 if cache_dtype == FP8 else 1.0
    shape = (num_blocks, BLOCK, KV_HEADS, DIM)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return {
        "k": (torch.randn(shape, generator=g, device=device) / scale).to(cache_dtype),
        "v": (torch.randn(shape, generator=g, device=device) / scale).to(cache_dtype),
        "q": torch.randn(batch, HEADS, DIM, generator=g, device=device).to(dtype),
        "tables": torch.randperm(num_blocks, generator=g, device=device).view(batch, blocks_per_seq).int(),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32, device=device),
        "scale": scale,
    }


def quest_point(batch: int, context: int, cache_dtype: torch.dtype, device: torch.device, runs: int) -> dict:
    c = cache(batch, context, cache_dtype, device, seed=batch)
    bounds = torch.zeros(c["k"].shape[0], 1, 2, KV_HEADS, DIM, dtype=sd.key_bounds_dtype(cache_dtype),
                         device=device)
    sd.update_key_bounds(c["k"], torch.arange(c["k"].shape[0] * BLOCK, device=device), bounds, c["scale"])
    bound_scale = sd.score_scale(bounds, DIM ** -0.5, c["scale"])
    budget_pages = min(2048, context) // BLOCK
    select_args = (c["q"], bounds, c["seq_lens"], c["tables"], bound_scale, BLOCK, budget_pages, 1, 2)
    selected = sd.quest_select(*select_args)
    out = torch.empty_like(c["q"])

    def attend() -> torch.Tensor:
        return sd.sparse_paged_decode(c["q"], c["k"], c["v"], c["seq_lens"], c["tables"], selected, DIM ** -0.5,
                                      c["scale"], c["scale"], out=out)

    row: dict[str, Any] = {"batch": batch, "context": context, "cache": str(cache_dtype).replace("torch.", ""),
                           "default_config": asdict(sd.STREAM_DEFAULT),
                           "attention_us": time_calls([attend], runs, device)[0]}
    row["select_default_us"] = time_calls([lambda: sd.quest_select(*select_args)], runs, device)[0]
    stream = []
    shapes = [sd.StreamConfig(block_b=b, programs_per_sm=p, num_warps=w, num_stages=s)
              for b, p, w, s in itertools.product((32, 64, 128), (4, 8, 16), (4, 8), (2, 3))]
    shapes += [sd.StreamConfig(select_warps=w) for w in (4, 8, 16)]
    for config in shapes if device.type == "cuda" else shapes[:2]:
        got = sd.quest_select(*select_args, config=config)
        entry = {"config": asdict(config), "same_selection": bool(torch.equal(got, selected))}
        if entry["same_selection"]:
            entry["select_us"] = time_calls([lambda cf=config: sd.quest_select(*select_args, config=cf)], runs,
                                            device)[0]
        stream.append(entry)
    timed = [e for e in stream if "select_us" in e]
    row["stream"] = stream
    row["mismatched_selections"] = sum(1 for e in stream if not e["same_selection"])
    if timed:
        best = min(timed, key=lambda e: e["select_us"])
        row["select_best_us"], row["select_best_config"] = best["select_us"], best["config"]
    return row


def main() -> int:
    args, device = sweep_script_args(__doc__)
    batches, context, runs = ([1], 256, 2) if args.smoke else ([1, 8, 32], 32768, 30)
    result: dict[str, Any] = {"suite": "quest-select-sweep", "device": str(device),
                              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                              "torch": torch.__version__, "token_budget": 2048, "page_size": BLOCK, "quest": []}
    path = args.out / "quest-select-sweep-h200.json"
    start = time.perf_counter()
    for cache_dtype in (torch.bfloat16, FP8):
        for batch in batches:
            row = quest_point(batch, context, cache_dtype, device, runs)
            result["quest"].append(row)
            result["seconds"] = time.perf_counter() - start
            path.write_text(json.dumps(result, indent=1))
            print(f"quest {row['cache']:>13} {batch:3d} x {context}: attention {row['attention_us']:6.1f} us; "
                  f"select default {row['select_default_us']:6.1f}, best {row.get('select_best_us', 0):6.1f} "
                  f"{row.get('select_best_config')}, mismatches {row['mismatched_selections']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
