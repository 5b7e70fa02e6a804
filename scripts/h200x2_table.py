"""The issue-18 tables from the JSON files `scripts/h200x2_parallel.sh OUT STAGE` wrote under OUT.

    python scripts/h200x2_table.py OUT

Prints, and writes to OUT/summary.json, the issue's targets as ratios: TP = 2 batch-1 decode / TP = 1 on the 8B
shape (<= 0.6), 70B BF16 TP = 2 batch-1 decode / its roofline (<= 1.3), zero engine errors (every expected run
left its result), greedy outputs of TP = 2 and PP = 2 equal TP = 1's; then the latency, throughput and all-reduce
tables. A missing file is reported as missing (its stage not run yet, or failed: see OUT/STAGE.log).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

TP2_DECODE_LIMIT = 0.6
ROOFLINE_70B_LIMIT = 1.3
LATENCY_RUNS = ("8b-latency-tp1", "8b-latency-tp2", "8b-latency-pp2", "70b-bf16-latency-tp2",
                "70b-fp8-latency-tp2", "70b-fp8-latency-tp1")
THROUGHPUT_RUNS = ("8b-throughput-tp1", "8b-throughput-tp2", "8b-throughput-pp2", "70b-bf16-throughput-tp2")


def load(out: Path, name: str) -> dict[str, Any] | None:
    path = out / f"{name}.json"
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    return result if result.get("complete", True) else None


def decode_row(result: dict[str, Any] | None, batch: int) -> dict[str, Any] | None:
    if result is None:
        return None
    rows = [r for r in result["rows"] if r["batch"] == batch and r.get("decode_ms_per_token")]
    return min(rows, key=lambda r: r["input_len"]) if rows else None


def target(text: str, measured: float | None, limit: float, passed: bool | None) -> dict[str, Any]:
    return {"target": text, "measured": measured, "limit": limit, "pass": passed}


def targets(out: Path) -> list[dict[str, Any]]:
    found = []
    tp1, tp2 = decode_row(load(out, "8b-latency-tp1"), 1), decode_row(load(out, "8b-latency-tp2"), 1)
    ratio = tp2["decode_ms_per_token"] / tp1["decode_ms_per_token"] if tp1 and tp2 else None
    found.append(target("8B FP8 batch-1 decode, TP=2 / TP=1", ratio, TP2_DECODE_LIMIT,
                        None if ratio is None else ratio <= TP2_DECODE_LIMIT))
    big = decode_row(load(out, "70b-bf16-latency-tp2"), 1)
    ratio = big["decode_x_roofline"] if big else None
    found.append(target("70B BF16 TP=2 batch-1 decode / roofline", ratio, ROOFLINE_70B_LIMIT,
                        None if ratio is None else ratio <= ROOFLINE_70B_LIMIT))
    expected = [*LATENCY_RUNS, *THROUGHPUT_RUNS]
    missing = [name for name in expected if load(out, name) is None]
    found.append(target(f"runs without a complete result (engine errors or not run): {missing}", len(missing), 0,
                        not missing))
    parity = load(out, "greedy-parity")
    if parity is None:
        found.append(target("greedy parity with TP=1 (not run)", None, 0, None))
    else:
        for t in parity["targets"]:
            found.append(target(f"greedy parity: {t['target']}", t["measured"], t["limit"], t["pass"]))
    return found


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def tables(out: Path) -> list[str]:
    lines = ["", f"{'latency run':24} {'batch':>5} {'decode ms':>9} {'roofline':>9} {'x roof':>6} {'TTFT ms':>8}"]
    for name in LATENCY_RUNS:
        result = load(out, name)
        for batch in (1, 32):
            row = decode_row(result, batch)
            if row:
                lines.append(f"{name:24} {batch:>5} {fmt(row['decode_ms_per_token']):>9} "
                             f"{fmt(row['decode_roofline_ms']):>9} {fmt(row.get('decode_x_roofline'), '.2f'):>6} "
                             f"{fmt(row['ttft_ms'], '.1f'):>8}")
        if result is None:
            lines.append(f"{name:24} missing")
    lines += ["", f"{'throughput run':24} {'prompts':>7} {'out tok/s':>10} {'total tok/s':>11} {'startup s':>9}  note"]
    for name in THROUGHPUT_RUNS:
        result = load(out, name)
        if result is None:
            lines.append(f"{name:24} missing")
            continue
        k = result["kestrel"]
        note = "truncated at --max-seconds" if k["truncated"] else ""
        lines.append(f"{name:24} {k['num_prompts']:>7} {k['output_tok_per_s']:10.1f} {k['total_tok_per_s']:11.1f} "
                     f"{result['startup_to_first_token_s']:9.1f}  {note}")
    ar = load(out, "allreduce")
    if ar is None:
        lines += ["", "allreduce missing"]
    else:
        bw = ar["bandwidth"]
        lines += ["", f"all-reduce: bus bandwidth {bw['busbw_GBps']:.1f} GB/s (algorithm {bw['algbw_GBps']:.1f})",
                  f"{'hidden':>6} {'tokens':>6} {'us/layer':>9} {'ms/step':>8} {'x bw-bound':>10}"]
        for r in ar["rows"]:
            lines.append(f"{r['hidden']:>6} {r['tokens']:>6} {r['us_per_layer']:9.2f} "
                         f"{fmt(r['ms_per_decode_step']):>8} {r['x_bandwidth_bound']:10.1f}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/h200x2_table.py OUT", file=sys.stderr)
        return 2
    out = Path(argv[0])
    found = targets(out)
    lines = ["issue 18 targets:"]
    for t in found:
        verdict = {True: "PASS", False: "FAIL", None: "----"}[t["pass"]]
        lines.append(f"{verdict}  {t['target']}: {fmt(t['measured'])} (limit {t['limit']})")
    print("\n".join(lines + tables(out)))
    (out / "summary.json").write_text(json.dumps({"targets": found}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
