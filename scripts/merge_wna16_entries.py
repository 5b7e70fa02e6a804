"""Merge a sweep's "N,K[,TYPE]" -> {M: config} entries (`wna16-8bit-entries.json` and the like) into a W4A16 / W8A16
GPU table: each (key, M) of the entries replaces the table's, the rest of the table is kept.

    python scripts/merge_wna16_entries.py TABLE ENTRIES [--out FILE] [--ms 128,256]   # --out defaults to TABLE
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def merge(table: dict, entries: dict[str, dict[str, dict]], ms: set[str] | None) -> list[str]:
    """Write `entries` into `table["configs"]` in place; returns the "key M" pairs that changed."""
    changed = []
    configs = table.setdefault("configs", {})
    for key, by_m in entries.items():
        row = configs.setdefault(key, {})
        for m, config in by_m.items():
            if ms is not None and m not in ms:
                continue
            if row.get(m) != config:
                changed.append(f"{key} M={m}")
            row[m] = config
        configs[key] = dict(sorted(row.items(), key=lambda t: int(t[0])))
    return changed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", type=Path)
    parser.add_argument("entries", type=Path)
    parser.add_argument("--out", type=Path, help="where the merged table goes (default: TABLE)")
    parser.add_argument("--ms", help="only these token-count buckets of the entries (comma-separated)")
    args = parser.parse_args()
    table = json.loads(args.table.read_text())
    ms = None if args.ms is None else set(args.ms.split(","))
    changed = merge(table, json.loads(args.entries.read_text()), ms)
    (args.out or args.table).write_text(json.dumps(table, indent=1) + "\n")
    print(f"{len(changed)} entries changed: " + ", ".join(changed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
