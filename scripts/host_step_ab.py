"""`kestrel bench host-step` of two trees, alternated: the working tree against a commit, round after round, so a
shared machine's drift falls on both alike. Writes every round and each tree's median and minimum per phase.

    python scripts/host_step_ab.py --before 42a3c16 --rounds 6 --out benchmarks/results/issue29/host-step/ab.json \
        -- --tokenizer .bench-tokenizer-128k --batch 256 --output-len 256 --repeats 3 --core-deltas --clock cpu \
        --modes unconstrained

The commit is written out with `git archive` into a temporary directory and run from there (`python -m` takes
the package from the directory it runs in); the arguments after `--` go to both runs unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_table(text: str) -> dict[str, dict[str, float]]:
    """The bench's summary table: a header line starting with `mode`, then one line per mode."""
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["mode"])
    columns = lines[header].split()[1:]
    rows = {}
    for line in lines[header + 1:]:
        fields = line.split()
        if len(fields) == len(columns) + 1:
            rows[fields[0]] = {name: float(value) for name, value in zip(columns, fields[1:])}
    return rows


def run_bench(tree: Path, bench_args: list[str]) -> dict[str, dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-m", "kestrel.bench.host_step", *bench_args], cwd=tree, env=env,
                          capture_output=True, text=True, check=True)
    return parse_table(done.stdout)


def summarize(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for mode in rounds[0]:
        phases = rounds[0][mode]
        out[mode] = {
            "median": {p: round(statistics.median(r[mode][p] for r in rounds), 3) for p in phases},
            "min": {p: round(min(r[mode][p] for r in rounds), 3) for p in phases},
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="the commit to compare the working tree against")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: kestrel bench host-step's arguments")
    args = p.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    sha = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    rounds: dict[str, list[dict[str, dict[str, float]]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp)
        archive = subprocess.run(["git", "archive", args.before], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
        for name in bench_args:  # a relative tokenizer directory resolves in the working tree for both runs
            if not name.startswith("-") and (ROOT / name).is_dir() and not (before / name).exists():
                (before / name).symlink_to(ROOT / name)
        for r in range(args.rounds):
            for tag, tree in (("before", before), ("after", ROOT)):
                rounds[tag].append(run_bench(tree, bench_args))
                step = {mode: phases.get("step") for mode, phases in rounds[tag][-1].items()}
                print(f"round {r + 1} {tag}: step {step}", file=sys.stderr)
    result = {
        "what": "kestrel bench host-step of a commit (before) and the working tree (after), alternated round by "
                "round; ms per decode step by phase, each round the bench's own median over its steps",
        "command": "python scripts/host_step_ab.py " + " ".join(sys.argv[1:]),
        "before": sha,
        "after": f"working tree at {head}",
        "host": {"machine": platform.machine(), "processor": _cpu_name(), "cores": os.cpu_count(),
                 "python": platform.python_version()},
        "summary": {tag: summarize(rs) for tag, rs in rounds.items()},
        "rounds": rounds,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for tag in ("before", "after"):
        print(tag, json.dumps(result["summary"][tag]))
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
