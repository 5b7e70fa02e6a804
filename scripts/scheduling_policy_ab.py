"""fcfs against shortest_prefill on one mixed workload: `kestrel serve` on the bundled kestrel-tiny (CPU), Poisson
arrivals of mostly short prompts with some long ones, measured by `kestrel bench serve` (TTFT by prompt length).
The policies alternate (A B A B ...) so that a slower stretch of a shared machine falls on both.

    .venv/bin/python scripts/scheduling_policy_ab.py --out benchmarks/results/scheduling
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "kestrel" / "models" / "kestrel-tiny"


def workload(path: Path, count: int, long_share: float, seed: int) -> None:
    """ShareGPT-shaped prompts cut from the standard library's source (the tokenizer's own kind of text): short
    ones of 5-20 words, long ones of 110-160 words (~250-400 tokens, within the model's 512-token context with
    the output)."""
    words = (Path(json.__file__).read_text() + Path(random.__file__).read_text()).split()
    rng = random.Random(seed)
    items = []
    for _ in range(count):
        size = rng.randint(110, 160) if rng.random() < long_share else rng.randint(5, 20)
        start = rng.randrange(len(words) - size)
        items.append({"conversations": [{"from": "human", "value": " ".join(words[start:start + size])},
                                        {"from": "gpt", "value": "x"}]})
    path.write_text(json.dumps(items))


def serve(policy: str, port: int, budget: int) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "kestrel.entrypoints.cli", "serve", str(MODEL), "--port",
                                str(port), "--device", "cpu", "--scheduling-policy", policy,
                                "--max-num-batched-tokens", str(budget), "--max-num-seqs", "32"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"kestrel serve --scheduling-policy {policy} did not start")


def run_bench(port: int, data: Path, rate: float, count: int, result: Path) -> dict:
    subprocess.run([sys.executable, "-m", "kestrel.entrypoints.cli", "bench", "serve", "--base-url",
                    f"http://127.0.0.1:{port}", "--dataset-name", "sharegpt", "--dataset-path", str(data),
                    "--sharegpt-output-len", "16", "--ignore-eos", "--request-rate", str(rate), "--num-prompts",
                    str(count), "--seed", "0", "--save-requests", "--result-file", str(result)],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())


def ttft_by_length(doc: dict, threshold: int) -> dict[str, dict[str, float]]:
    """TTFT p50 / p99 (ms) of the short and the long prompts, and of all."""
    records = [r for r in doc["results"][0]["requests"] if r["success"]]
    groups = {"all": records, "short": [r for r in records if r["prompt_tokens"] < threshold],
              "long": [r for r in records if r["prompt_tokens"] >= threshold]}
    out = {}
    for name, rows in groups.items():
        ttft = sorted(r["chunk_times_s"][0] * 1e3 for r in rows)
        out[name] = {"count": len(ttft), "p50": statistics.median(ttft) if ttft else None,
                     "p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--rate", type=float, default=15.0, help="Poisson arrivals per second")
    p.add_argument("--long-share", type=float, default=0.2)
    p.add_argument("--budget", type=int, default=512, help="--max-num-batched-tokens of the server")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--port", type=int, default=8791)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "mixed_prompts.json"
    workload(data, args.requests, args.long_share, seed=0)
    runs = []
    for round_index in range(args.rounds):
        for policy in ("fcfs", "shortest_prefill"):
            server = serve(policy, args.port, args.budget)
            try:
                doc = run_bench(args.port, data, args.rate, args.requests,
                                args.out / f"serve_{policy}_{round_index}.json")
            finally:
                server.terminate()
                server.wait(30)
            runs.append({"policy": policy, "round": round_index, "ttft_ms": ttft_by_length(doc, threshold=200)})
            print(json.dumps(runs[-1]))
    summary = {"command": " ".join(sys.argv), "rate_per_s": args.rate, "requests": args.requests,
               "long_share": args.long_share, "max_num_batched_tokens": args.budget, "runs": runs}
    (args.out / "policy_ab.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
