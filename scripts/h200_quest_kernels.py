"""Quest's decode kernels on one GPU, the earlier path against the new one, at the 8B shape (32 / 8 heads of 128,
BF16 KV, blocks of 16): contexts 8k, 32k, 100k x batch 1, 8, 32 x pages of 16 and 8, token budget 2048 (1 sink and
2 recent blocks, as `kestrel bench sparse-attention --mode speed` uses).

Per point, each timed as CUDA-graph replays (`kestrel.bench.timing.time_calls`, median):
- scores: the page-score kernel alone ("topk": 16 pages a program; "stream": many pages a program, tensor cores);
- select: scores + page selection ("topk": + torch top-k and sort; "stream": + the Triton radix select);
- attention: sparse attention over the selected pages ("topk" path: torch merge of split partials; "stream"
  path: Triton merge);
- step: one decode step's Quest work, `update_key_bounds` of the token written + select + attention, against
  dense paged decode attention (`ops.paged_attention`) over the whole context.
Checks per point (before timing): the stream scores against the earlier kernel's; the stream selection equal to
the reference selection (`select_pages`, ties to the lower page) of the same scores, tie for tie; its overlap with
the earlier top-k's pages; the two paths' attention outputs on the stream selection; at 8k and batch <= 8 the whole
stream selection equal to `quest_select_ref` on integer (exact) scores. Then a few StreamConfig launch shapes of
the scores kernel at 3 points. Writes OUT/quest-kernels-h200.json (rewritten after every point) and prints a table.

    PYTHONPATH=. python scripts/h200_quest_kernels.py --out OUT             # the H200 run, about 2-4 minutes
    TRITON_INTERPRET=1 PYTHONPATH=. python scripts/h200_quest_kernels.py --out OUT --smoke  # CPU check of this script
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel import ops  # noqa: E402
from kestrel.bench.timing import time_calls  # noqa: E402
from kestrel.kernels import sparse_decode as sd  # noqa: E402

BLOCK = 16
SINK_BLOCKS, RECENT_BLOCKS = 1, 2
SWEEP = [sd.StreamConfig(), sd.StreamConfig(programs_per_sm=4), sd.StreamConfig(programs_per_sm=16),
         sd.StreamConfig(block_b=64), sd.StreamConfig(block_b=64, programs_per_sm=4, num_stages=4),
         sd.StreamConfig(block_b=16, programs_per_sm=16), sd.StreamConfig(num_warps=8, block_b=64)]


class Pool:
    """One shared pool of random K/V blocks (the largest point's), with per-page-size bounds kept by
    update_key_bounds; each point takes its sequences' blocks from it at random."""

    def __init__(self, num_blocks: int, kv_heads: int, dim: int, pages: list[int], device: torch.device) -> None:
        g = torch.Generator(device=device).manual_seed(0)
        shape = (num_blocks, BLOCK, kv_heads, dim)
        self.k = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        self.v = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        self.bounds = {}
        for page in pages:
            bounds = torch.zeros(num_blocks, BLOCK // page, 2, kv_heads, dim, dtype=sd.key_bounds_dtype(torch.bfloat16),
                                 device=device)
            slots = torch.arange(num_blocks * BLOCK, device=device)
            for chunk in slots.split(1 << 22):  # the bound kernel's grid is one program per slot
                sd.update_key_bounds(self.k, chunk, bounds) if device.type == "cuda" else \
                    sd.update_key_bounds_ref(self.k, chunk, bounds)
            self.bounds[page] = bounds
        self.generator = g


def point(pool: Pool, batch: int, context: int, page: int, budget: int, heads: int, device: torch.device,
          runs: int) -> dict[str, Any]:
    kv_heads, dim = pool.k.shape[2], pool.k.shape[3]
    g = pool.generator
    blocks_per_seq = -(-context // BLOCK)
    tables = torch.randperm(pool.k.shape[0], generator=g, device=device)[: batch * blocks_per_seq]
    tables = tables.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, dim, generator=g, device=device, dtype=torch.bfloat16)
    bounds, k, v = pool.bounds[page], pool.k, pool.v
    scale = dim ** -0.5
    num_selected = budget // page
    pages = BLOCK // page
    sinks, recent = SINK_BLOCKS * pages, RECENT_BLOCKS * pages
    last = seq_lens.long() - 1
    slot = tables.long().gather(1, (last // BLOCK)[:, None])[:, 0] * BLOCK + last % BLOCK
    query_start = torch.arange(batch + 1, dtype=torch.int32, device=device)
    out_dense, out_old, out_new = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
    config = sd.STREAM_DEFAULT

    def scores_old() -> torch.Tensor:
        return sd.quest_block_scores(q, bounds, seq_lens, tables, scale, BLOCK, impl="topk")

    def scores_new() -> torch.Tensor:
        return sd.quest_block_scores(q, bounds, seq_lens, tables, scale, BLOCK, impl="stream", config=config)

    def select(impl: str) -> torch.Tensor:
        return sd.quest_select(q, bounds, seq_lens, tables, scale, BLOCK, num_selected, SINK_BLOCKS, RECENT_BLOCKS,
                               impl=impl, config=config)

    sel_old, sel_new = select("topk"), select("stream")

    def attend(impl: str, selected: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return sd.sparse_paged_decode(q, k, v, seq_lens, tables, selected, scale, out=out, page_size=page,
                                      merge="torch" if impl == "topk" else "triton")

    def step(impl: str, out: torch.Tensor) -> torch.Tensor:
        sd.update_key_bounds(k, slot, bounds) if device.type == "cuda" else sd.update_key_bounds_ref(k, slot, bounds)
        return attend(impl, select(impl), out)

    def dense() -> object:
        return ops.paged_attention(q, k, v, query_start, seq_lens, tables, scale, out=out_dense, max_query_len=1)

    # ---- checks
    s_old, s_new = scores_old(), scores_new()
    live = torch.isfinite(s_old)
    scores_err = (float((s_new - s_old)[live].abs().max() / s_old[live].abs().max().clamp_min(1e-30))
                  if live.any() else 0.0)  # relative to the largest score
    same_selection = bool(torch.equal(sel_new, sd.select_pages(s_new, seq_lens, page, num_selected, sinks, recent)))
    overlap = page_overlap(sel_old, sel_new, tables.shape[1] * pages)
    a_old = attend("topk", sel_new, out_old).float()
    a_new = attend("stream", sel_new, out_new).float()
    attention_err = float((a_new - a_old).abs().max())
    exact = None
    if context <= 8192 and batch <= 8:
        qi = torch.randint(-2, 3, q.shape, generator=g, device=device).to(q.dtype)
        lo = torch.randint(-4, 4, (batch * blocks_per_seq, pages, kv_heads, dim), generator=g, device=device).float()
        ib = torch.stack([lo, lo + torch.randint(0, 3, lo.shape, generator=g, device=device).float()], 2)
        ib = ib.to(torch.bfloat16)
        it = torch.randperm(batch * blocks_per_seq, generator=g, device=device).view(batch, blocks_per_seq).int()
        args = (qi, ib, seq_lens, it, 0.25, BLOCK, num_selected, SINK_BLOCKS, RECENT_BLOCKS)
        exact = bool(torch.equal(sd.quest_select(*args), sd.quest_select_ref(*args)))
        del lo, ib
    ok = (scores_err < 1e-3 and same_selection and attention_err < 5e-2 and overlap > 0.95 and exact is not False
          and bool(torch.isfinite(a_new).all()))

    # ---- timing
    timed = {"dense": dense, "old_scores": scores_old, "new_scores": scores_new,
             "old_select": lambda: select("topk"), "new_select": lambda: select("stream"),
             "old_attention": lambda: attend("topk", sel_old, out_old),
             "new_attention": lambda: attend("stream", sel_new, out_new),
             "old_step": lambda: step("topk", out_old), "new_step": lambda: step("stream", out_new)}
    t, graphed = {}, {}
    for name, call in timed.items():
        t[f"{name}_us"], graphed[name] = time_calls([call], runs, device)
    bounds_bytes = batch * blocks_per_seq * pages * 2 * kv_heads * dim * bounds.element_size()
    kv_bytes = 2 * batch * context * kv_heads * dim * k.element_size()
    return {
        "batch": batch, "context": context, "page_size": page, "token_budget": budget, "num_selected": num_selected,
        **{key: round(val, 2) for key, val in t.items()},
        "old_speedup": t["dense_us"] / t["old_step_us"], "new_speedup": t["dense_us"] / t["new_step_us"],
        "select_gain": t["old_select_us"] / t["new_select_us"],
        "new_scores_tb_s": bounds_bytes / t["new_scores_us"] / 1e6,
        "old_scores_tb_s": bounds_bytes / t["old_scores_us"] / 1e6,
        "dense_tb_s": kv_bytes / t["dense_us"] / 1e6, "bounds_bytes": bounds_bytes, "dense_kv_bytes": kv_bytes,
        "cuda_graphs": graphed,
        "checks": {"ok": ok, "scores_rel_err_vs_topk_kernel": scores_err, "selection_equals_reference": same_selection,
                   "page_overlap_with_topk": overlap, "attention_max_abs_diff_merges": attention_err,
                   "exact_scores_selection_equals_quest_select_ref": exact},
    }


def page_overlap(old: torch.Tensor, new: torch.Tensor, width: int) -> float:
    """Share of the new selection's pages that the old one holds too (-1 slots left out)."""
    held = torch.zeros(*old.shape[:2], width + 1, dtype=torch.bool, device=old.device)
    held.scatter_(2, torch.where(old < 0, width, old).long(), True)
    used = new >= 0
    hits = held.gather(2, torch.where(used, new, width).long()) & used
    return float(hits.sum()) / max(1, int(used.sum()))


def sweep(pool: Pool, shapes: list[tuple[int, int, int]], heads: int, device: torch.device,
          runs: int) -> list[dict[str, Any]]:
    """The scores kernel (as the selection runs it) at each StreamConfig of SWEEP."""
    rows = []
    for batch, context, page in shapes:
        g = pool.generator
        blocks_per_seq = -(-context // BLOCK)
        tables = torch.randperm(pool.k.shape[0], generator=g, device=device)[: batch * blocks_per_seq]
        tables = tables.view(batch, blocks_per_seq).to(torch.int32)
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        q = torch.randn(batch, heads, pool.k.shape[3], generator=g, device=device, dtype=torch.bfloat16)
        bounds = pool.bounds[page]
        bounds_bytes = batch * blocks_per_seq * (BLOCK // page) * 2 * pool.k.shape[2] * pool.k.shape[3] * 2
        for config in SWEEP:
            def scores(q=q, bounds=bounds, lens=lens, tables=tables, config=config) -> torch.Tensor:
                return sd.quest_block_scores(q, bounds, lens, tables, 0.1, BLOCK, impl="stream", config=config)
            us = time_calls([scores], runs, device)[0]
            rows.append({"batch": batch, "context": context, "page_size": page, "config": asdict(config),
                         "scores_us": round(us, 2), "tb_s": bounds_bytes / us / 1e6})
            print(f"  sweep {batch:3d} x {context:6d} page {page:2d} {asdict(config)}: {us:8.1f} us "
                  f"({rows[-1]['tb_s']:.2f} TB/s)", flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'batch x ctx':>13} {'pg':>2} | {'dense':>7} | {'scores old/new':>15} | {'select old/new':>15} | "
            f"{'attn old/new':>13} | {'step old/new':>15} | {'speedup old/new':>15} | {'new TB/s':>8} | ok")
    lines = [head, "-" * len(head)]
    for r in rows:
        pair = [f"{r['old_' + k + '_us']:7.1f}/{r['new_' + k + '_us']:<7.1f}"
                for k in ("scores", "select", "attention", "step")]
        lines.append(
            f"{r['batch']:>5} x {r['context']:>6} {r['page_size']:>2} | {r['dense_us']:7.1f} | {pair[0]} | {pair[1]} | "
            f"{pair[2]:>13} | {pair[3]} | {r['old_speedup']:6.2f}x/{r['new_speedup']:6.2f}x | "
            f"{r['new_scores_tb_s']:8.2f} | {r['checks']['ok']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for quest-kernels-h200.json")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (run under TRITON_INTERPRET=1)")
    p.add_argument("--time-limit", type=float, default=270.0,
                   help="seconds; points not started by then are skipped (the JSON says which)")
    args = p.parse_args(argv)
    started = time.perf_counter()
    if args.smoke:
        device = torch.device("cpu")
        contexts, batches, pages, budget, heads, kv_heads, dim, runs = [256, 512], [1, 2], [16, 8], 128, 8, 2, 32, 2
        sweep_shapes = [(2, 512, 8)]
    else:
        device = torch.device("cuda")
        contexts, batches, pages, budget, heads, kv_heads, dim, runs = ([8192, 32768, 100000], [1, 8, 32], [16, 8],
                                                                        2048, 32, 8, 128, 20)
        sweep_shapes = [(1, 32768, 16), (32, 32768, 16), (32, 100000, 8)]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "quest-kernels-h200.json"
    num_blocks = max(batches) * -(-max(contexts) // BLOCK)
    pool = Pool(num_blocks, kv_heads, dim, pages, device)
    result: dict[str, Any] = {
        "suite": "quest-kernels", "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__, "python": platform.python_version(), "heads": heads, "kv_heads": kv_heads,
        "head_size": dim, "block_size": BLOCK, "sink_blocks": SINK_BLOCKS, "recent_blocks": RECENT_BLOCKS,
        "stream_config": asdict(sd.STREAM_DEFAULT), "rows": [], "skipped": [], "errors": [], "sweep": [],
    }

    def save() -> None:
        result["seconds"] = round(time.perf_counter() - started, 1)
        path.write_text(json.dumps(result, indent=1))

    print(f"pool of {num_blocks} blocks ready after {time.perf_counter() - started:.1f} s", flush=True)
    for context in contexts:
        for batch in batches:
            for page in pages:
                where = {"batch": batch, "context": context, "page_size": page}
                if time.perf_counter() - started > args.time_limit:
                    result["skipped"].append(where)
                    continue
                try:
                    row = point(pool, batch, context, page, budget, heads, device, runs)
                except Exception as exc:  # one failing point must not lose the others
                    result["errors"].append({**where, "error": f"{type(exc).__name__}: {exc}"})
                    print(f"ERROR at {where}: {type(exc).__name__}: {exc}", flush=True)
                    save()
                    continue
                result["rows"].append(row)
                print(table([row]).splitlines()[-1], flush=True)
                save()
    if time.perf_counter() - started < args.time_limit + 30:
        try:
            result["sweep"] = sweep(pool, sweep_shapes, heads, device, runs)
        except Exception as exc:
            result["errors"].append({"sweep": True, "error": f"{type(exc).__name__}: {exc}"})
    save()
    print()
    print(table(result["rows"]))
    ok = all(r["checks"]["ok"] for r in result["rows"]) and not result["errors"]
    print(f"\nchecks {'pass' if ok else 'FAIL'}; {len(result['rows'])} points, {len(result['skipped'])} skipped, "
          f"{len(result['errors'])} errors; {result['seconds']} s -> {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
