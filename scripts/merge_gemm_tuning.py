"""Merge the M buckets of a `kestrel bench gemm --tune-only --tune-out FILE` run into the committed table.

    python scripts/merge_gemm_tuning.py FILE [TABLE]

Entries of FILE replace those of TABLE for the same (dtype, N,K, M bucket); the rest of TABLE is kept.
TABLE defaults to the H200 table in kestrel/kernels/tuning.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[1] / "kestrel" / "kernels" / "tuning" / "scaled_mm_nvidia_h200.json"


def merge(new_path: Path, table_path: Path) -> list[str]:
    new = json.loads(new_path.read_text())["configs"]
    table = json.loads(table_path.read_text())
    changed = []
    for dtype, shapes in new.items():
        for shape, buckets in shapes.items():
            for bucket, cfg in buckets.items():
                table["configs"].setdefault(dtype, {}).setdefault(shape, {})[bucket] = cfg
                changed.append(f"{dtype} {shape} M<={bucket}")
    table_path.write_text(json.dumps(table, indent=1) + "\n")
    return changed


if __name__ == "__main__":
    target = Path(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT
    for line in merge(Path(sys.argv[1]), target):
        print("merged", line)
