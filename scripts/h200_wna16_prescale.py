"""The prescaled W4A16 tiles (`kernels/wna16_tc.py`, `WNA16Config.prescale`) against the committed table, the dense
path (the weight written out, then cuBLAS) and cuBLAS BF16, on Llama-3-8B's four linears, int4 group 128, bf16
activations, M = 16 .. 2048. Every config is first checked against the float64 product, then timed as CUDA-graph
replays over weight copies rotated past L2 (`h200_wna16_sweep.measure`).

Variants: ps1 / ps1n: one dot per K step over the tile put in natural K order (weights as the first operand /
second operand); ps8 / ps8n: eight nibble dots per K step over x's permuted columns (the permutation's gather is
timed with the call).

Writes OUT/wna16-prescale-h200.json (every timing, the best per (shape, M)) and prints a summary.

    python scripts/h200_wna16_prescale.py --out OUT [--ms 16,64,256] [--max-seconds 300]
    python scripts/h200_wna16_prescale.py --out OUT --dry-run   # CPU, Triton interpreter, tiny shapes
"""

from __future__ import annotations

import json
import time

M_ORDER = [256, 64, 16, 1, 1024, 128, 32, 4, 2048, 512, 8, 2]


def variant_of(cfg) -> str:
    if cfg.dense:
        return "dense"
    if not cfg.prescale:
        return "table"
    return ("ps8" if cfg.nibble_dots else "ps1") + ("" if cfg.swap_ab else "n")


def grid(M: int, wq) -> list:
    C = wq.WNA16Config
    out = []

    def ps(bm, bn, warps, stages, swap, nib, split=0, group_m=8):
        out.append(C(bm, bn, 128, split, group_m, warps, stages, nibble_dots=nib, swap_ab=swap, prescale=True))

    if M <= 32:
        bm = 16 if M <= 16 else 32
        for bn, warps, stages, split in ((64, 4, 4, 0), (64, 4, 4, 16), (128, 4, 4, 0), (128, 4, 4, 8),
                                         (128, 8, 4, 0), (256, 8, 3, 0)):
            for nib in (False, True):
                ps(bm, bn, warps, stages, True, nib, split=split, group_m=1)
    elif M <= 64:
        for bn, warps, stages in ((64, 4, 4), (128, 4, 4), (128, 8, 4), (256, 8, 3)):
            for nib in (False, True):
                ps(64, bn, warps, stages, True, nib, group_m=1)
        for bn, warps in ((128, 4), (256, 8)):
            for nib in (False, True):
                ps(64, bn, warps, 3, False, nib, group_m=1)
    else:
        for bm, bn in ((128, 128), (128, 256)):  # (256 rows with swap_ab: wna16_tc.MAX_SWAP_ROWS)
            ps(bm, bn, 8, 3, True, False, split=1)
        ps(128, 128, 8, 3, True, True, split=1)
        for bm, bn in ((128, 128), (128, 256), (256, 128), (64, 256)):
            for nib in (False, True):
                ps(bm, bn, 8, 3, False, nib, split=1)
    return out


def dense_config():
    """A table entry for the dense path (the weight written out, then cuBLAS; its blocks serve only where the path
    does not apply)."""
    from kestrel.kernels import wna16 as wq

    return wq.WNA16Config(64, 64, 64, dense=True)


def run(args, save) -> dict:
    import h200_wna16_sweep as sweep

    from kestrel.kernels import wna16 as wq

    dev = "cpu" if args.dry_run else "cuda"
    shapes = {"a": (64, 256), "b": (96, 512)} if args.dry_run else sweep.SHAPES  # K holds whole 128-row groups
    ms = [3, 40, 130] if args.dry_run else [m for m in M_ORDER if m in args.ms]
    started = time.time()

    time_calls = sweep.call_timer(args.dry_run)

    data = sweep.rotated_weights(shapes, dev, args.dry_run)
    result = sweep.new_result(shapes)
    rows, best, skipped = result["rows"], result["best"], result["skipped"]
    for M in ms:
        configs = grid(M, wq)
        if args.dry_run:
            seen: dict[str, object] = {}
            for c in configs:
                seen.setdefault(variant_of(c), c)
            configs = [wq.WNA16Config(16, 32, 128, c.split_k, 1, 4, 2, nibble_dots=c.nibble_dots,
                                      swap_ab=c.swap_ab, prescale=True) for c in seen.values()]
        for name, (N, K, weights, dense64, dense) in data.items():
            if time.time() - started > args.max_seconds:
                skipped.append(f"{name} M={M}")
                continue
            x, ref, mm_us = sweep.case_inputs(M, K, dense64, dense, dev, time_calls)
            abs_ref = x.double().abs() @ dense64.abs().T
            case = {"shape": name, "N": N, "K": K, "M": M, "bf16_mm_us": mm_us}
            table_cfg = wq.select_config(N, K, M, x.device)
            cands = [sweep.Candidate("table", table_cfg), sweep.Candidate("dense", dense_config())]
            cands += [sweep.Candidate(variant_of(c), c) for c in configs]
            timed = sweep.measure(case, cands, x, weights, ref, time_calls,
                                  check=lambda out, ref_, a=abs_ref: sweep.check_rounded(out, ref_, a))
            rows += timed
            entry = None
            for r in timed:
                if "us" in r and r["variant"] not in ("table", "dense") and (entry is None or r["us"] < entry["us"]):
                    entry = {k: r[k] for k in ("us", "bf16_mm_us", "speedup_vs_bf16", "variant", "config")}
            table_us, dense_us = (timed[i].get("us", float("nan")) for i in (0, 1))
            if entry is not None:
                entry["table_us"], entry["dense_us"] = table_us, dense_us
                best.setdefault(f"{N},{K}", {})[str(M)] = entry
                print(f"{name:8s} M={M:4d}: prescaled {entry['us']:8.1f} us {entry['variant']:5s} "
                      f"({entry['speedup_vs_bf16']:.2f}x cuBLAS {mm_us:.1f}); table {table_us:.1f} "
                      f"({mm_us / table_us:.2f}x); dense {dense_us:.1f} ({mm_us / dense_us:.2f}x) "
                      f"[{time.time() - started:.0f} s]", flush=True)
            result["seconds"] = time.time() - started
            save(result)
    return result


def candidate_table(result: dict, current: dict) -> dict:
    """The committed table with, per (shape, M) measured, the fastest of the prescaled best, the dense path and the
    current entry, a new entry only where it is >= 3% faster than the current one. M buckets past the table's
    largest get their own entry (the current one is the largest bucket's)."""
    from kestrel.kernels import wna16 as wq

    table = {nk: dict(ms) for nk, ms in current.get("configs", {}).items()}
    chosen = {}
    for nk, per_m in result["best"].items():
        for m, e in per_m.items():
            now = e["table_us"]
            options = [(e["us"], e["config"], e["variant"]), (e["dense_us"], dense_config().to_json(), "dense")]
            us, cfg, variant = min(options, key=lambda o: o[0] if o[0] == o[0] else float("inf"))
            if not us < 0.97 * now:
                entry = wq.lookup(table.get(nk, {}), int(m))
                cfg, variant, us = (entry.to_json() if entry else cfg), "table", now
            table.setdefault(nk, {})[m] = cfg
            chosen[f"{nk} M={m}"] = {"variant": variant, "us": us, "table_us": now}
    configs = {nk: dict(sorted(ms.items(), key=lambda t: int(t[0]))) for nk, ms in table.items()}
    return {"gpu": current.get("gpu", "nvidia_h200"), "note": current.get("note", ""), "configs": configs,
            "chosen": chosen}


def main() -> int:
    import h200_wna16_sweep as sweep

    args, device = sweep.parse_args(__doc__, M_ORDER)

    def save(result: dict) -> None:
        result["device"] = device
        (args.out / "wna16-prescale-h200.json").write_text(json.dumps(result, indent=1) + "\n")

    result = run(args, save)
    save(result)
    from kestrel.kernels import common

    current = json.loads((common.TUNING_DIR / "wna16_nvidia_h200.json").read_text())
    candidate = candidate_table(result, current)
    (args.out / "wna16_nvidia_h200.json").write_text(json.dumps(
        {k: v for k, v in candidate.items() if k != "chosen"}, indent=1) + "\n")
    for key, c in candidate["chosen"].items():
        print(f"{key}: {c['variant']} {c['us']:.1f} us (table {c['table_us']:.1f})", flush=True)
    errors = [r for r in result["rows"] if "error" in r]
    print(f"{len(result['rows'])} rows, {len(errors)} failed: "
          + "; ".join(f"{r['variant']} {r['shape']} M={r['M']}: {r['error'][:120]}" for r in errors[:8]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
