"""Ratios after / before from the JSON of scripts/h200_before_after.sh: `python scripts/before_after_table.py OUT...`.

Latency rows (decode ms/token, TTFT) take the median over the repeated runs of each side; throughput takes output
tokens/s. Prints one table and writes OUT[0]/before-after.json."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main() -> int:
    dirs = [Path(p) for p in sys.argv[1:]]
    files = [f for d in dirs for f in sorted(d.glob("*-before-*.json")) + sorted(d.glob("*-after-*.json"))]
    values: dict[tuple[str, str], dict[str, list[float]]] = {}
    for f in files:
        kind, side = f.stem.rsplit("-", 2)[0], f.stem.rsplit("-", 2)[1]
        data = json.loads(f.read_text())
        if "rows" in data:
            for row in data["rows"]:
                for metric in ("decode_ms_per_token", "ttft_ms"):
                    key = (f"{kind} batch {row['batch']}", metric)
                    values.setdefault(key, {}).setdefault(side, []).append(row[metric])
        else:
            key = (kind, "output_tok_per_s")
            values.setdefault(key, {}).setdefault(side, []).append(data["kestrel"]["output_tok_per_s"])
    table = []
    print(f"{'workload':<24} {'metric':<20} {'before':>10} {'after':>10} {'after/before':>13}")
    for (workload, metric), sides in values.items():
        if "before" not in sides or "after" not in sides:
            continue
        before, after = statistics.median(sides["before"]), statistics.median(sides["after"])
        table.append({"workload": workload, "metric": metric, "before": sides["before"], "after": sides["after"],
                      "ratio": after / before})
        print(f"{workload:<24} {metric:<20} {before:>10.3f} {after:>10.3f} {after / before:>13.3f}")
    (dirs[0] / "before-after.json").write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
