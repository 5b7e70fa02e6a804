"""Quest's sparse decode attention (`sparse_paged_decode`) over launch shapes (`AttentionConfig`) on one GPU, at
the 8B shape (32 / 8 heads of 128, blocks of 16), context 32k, token budget 2048 (pages of 16; 1 sink and 2
recent blocks), batch 1, 8, 32, BF16 and FP8 caches. Per point: dense decode attention over the whole context,
the selection (default `StreamConfig`), each launch shape's sparse attention (checked against
`sparse_paged_decode_ref` first), and the whole Quest step (bounds update + selection + attention) with the
default shape (`attention_config`) and with the point's fastest one, against dense. Each timed as CUDA-graph replays
(`kestrel.bench.timing.time_calls`, median). Writes OUT/sparse-attention-sweep-h200.json after every point.

    PYTHONPATH=. python scripts/h200_sparse_attention_sweep.py --out OUT          # the H200 run, about 3 minutes
    TRITON_INTERPRET=1 PYTHONPATH=. python scripts/h200_sparse_attention_sweep.py --out OUT --smoke  # CPU check
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel import ops  # noqa: E402
from kestrel.bench.timing import sweep_script_args, time_calls  # noqa: E402
from kestrel.kernels import sparse_decode as sd  # noqa: E402

BLOCK = 16
SINK_BLOCKS, RECENT_BLOCKS = 1, 2
FP8 = torch.float8_e4m3fn
SHAPES = [sd.AttentionConfig(keys_per_tile=16),
          sd.AttentionConfig(num_stages=2), sd.AttentionConfig(num_stages=3), sd.AttentionConfig(num_stages=4),
          sd.AttentionConfig(keys_per_tile=32), sd.AttentionConfig(keys_per_tile=32, num_stages=2),
          sd.AttentionConfig(keys_per_tile=32, num_stages=3), sd.AttentionConfig(keys_per_tile=64),
          sd.AttentionConfig(keys_per_tile=64, num_stages=2), sd.AttentionConfig(keys_per_tile=32, num_warps=8),
          sd.AttentionConfig(keys_per_tile=64, num_warps=8, num_stages=2),
          sd.AttentionConfig(programs_per_sm=8), sd.AttentionConfig(keys_per_tile=32, programs_per_sm=8),
          sd.AttentionConfig(keys_per_tile=32, num_stages=3, programs_per_sm=8)]


def point(batch: int, context: int, cache_dtype: torch.dtype, device: torch.device, runs: int,
          shapes: list[sd.AttentionConfig]) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(batch)
    heads, kv_heads, dim = 32, 8, 128
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq
    k_scale = v_scale = 1 / 64 if cache_dtype == FP8 else 1.0
    shape = (num_blocks, BLOCK, kv_heads, dim)
    k = (torch.randn(shape, generator=g, device=device) / k_scale).to(cache_dtype)
    v = (torch.randn(shape, generator=g, device=device) / v_scale).to(cache_dtype)
    q = torch.randn(batch, heads, dim, generator=g, device=device, dtype=torch.bfloat16)
    if device.type != "cuda":
        q = q.float()
    tables = torch.randperm(num_blocks, generator=g, device=device).view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query_start = torch.arange(batch + 1, dtype=torch.int32, device=device)
    bounds = torch.zeros(num_blocks, 1, 2, kv_heads, dim, dtype=sd.key_bounds_dtype(cache_dtype), device=device)
    ops.update_key_bounds(k, torch.arange(num_blocks * BLOCK, device=device), bounds, k_scale)
    scale = dim ** -0.5
    bound_scale = sd.score_scale(bounds, scale, k_scale)
    num_selected = 2048 // BLOCK
    last = seq_lens.long() - 1
    slot = tables.long().gather(1, (last // BLOCK)[:, None])[:, 0] * BLOCK + last % BLOCK
    out = torch.empty_like(q)

    def select() -> torch.Tensor:
        return ops.quest_select(q, bounds, seq_lens, tables, bound_scale, BLOCK, num_selected, SINK_BLOCKS,
                                RECENT_BLOCKS)

    selected = select()

    def attend(config: sd.AttentionConfig) -> torch.Tensor:
        return sd.sparse_paged_decode(q, k, v, seq_lens, tables, selected, scale, k_scale, v_scale, out=out,
                                      config=config)

    def step(config: sd.AttentionConfig) -> torch.Tensor:
        ops.update_key_bounds(k, slot, bounds, k_scale)
        return sd.sparse_paged_decode(q, k, v, seq_lens, tables, select(), scale, k_scale, v_scale, out=out,
                                      config=config)

    def dense() -> object:
        return ops.paged_attention(q, k, v, query_start, seq_lens, tables, scale, None, k_scale, v_scale,
                                   out=torch.empty_like(q), max_query_len=1)

    want = sd.sparse_paged_decode_ref(q.float(), k, v, seq_lens, tables, selected, scale, k_scale, v_scale).float()
    row: dict[str, Any] = {"batch": batch, "context": context, "cache": str(cache_dtype).replace("torch.", ""),
                           "dense_us": time_calls([dense], runs, device)[0],
                           "select_us": time_calls([select], runs, device)[0], "shapes": []}
    for config in shapes:
        got = attend(config).float()
        err = float((got - want).abs().max())
        entry = {"config": asdict(config), "max_abs_err": err, "ok": bool(err < 3e-2 and torch.isfinite(got).all())}
        if entry["ok"]:
            entry["attention_us"] = time_calls([lambda c=config: attend(c)], runs, device)[0]
        row["shapes"].append(entry)
    timed = [e for e in row["shapes"] if e["ok"]]
    best = min(timed, key=lambda e: e["attention_us"]) if timed else None
    row["first_shape_attention_us"] = row["shapes"][0].get("attention_us")
    row["default_config"] = asdict(sd.attention_config(cache_dtype))
    row["default_step_us"] = time_calls([lambda: step(sd.attention_config(cache_dtype))], runs, device)[0]
    row["default_speedup"] = row["dense_us"] / row["default_step_us"]
    if best is not None:
        row["best_config"] = best["config"]
        row["best_attention_us"] = best["attention_us"]
        row["best_step_us"] = time_calls([lambda: step(sd.AttentionConfig(**best["config"]))], runs, device)[0]
        row["best_speedup"] = row["dense_us"] / row["best_step_us"]
    return row


def main() -> int:
    args, device = sweep_script_args(__doc__)
    context, batches, runs = (4096, [1, 2], 2) if args.smoke else (32768, [1, 8, 32], 30)
    shapes = SHAPES[:3] if args.smoke else SHAPES
    result: dict[str, Any] = {"suite": "sparse-attention-sweep", "device": str(device),
                              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                              "torch": torch.__version__, "context": context, "token_budget": 2048,
                              "page_size": BLOCK, "rows": []}
    start = time.perf_counter()
    for cache_dtype in (torch.bfloat16, FP8):
        for batch in batches:
            row = point(batch, context, cache_dtype, device, runs, shapes)
            result["rows"].append(row)
            result["seconds"] = time.perf_counter() - start
            (args.out / "sparse-attention-sweep-h200.json").write_text(json.dumps(result, indent=1))
            print(f"{row['cache']:>13} batch {batch:2d}: dense {row['dense_us']:7.1f} us, select "
                  f"{row['select_us']:6.1f}, attention 16 keys a step {row['first_shape_attention_us'] or 0:6.1f} best "
                  f"{row.get('best_attention_us', 0):6.1f} {row.get('best_config')}; step default "
                  f"{row['default_speedup']:.2f}x, best {row.get('best_speedup', 0):.2f}x", flush=True)
            torch.cuda.empty_cache() if device.type == "cuda" else None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
