#!/usr/bin/env bash
# TP = 1 through the worker-process executor vs today's in-process engine, on one GPU:
#   scripts/h200_tp1_regression.sh OUT [extra kestrel.bench.latency flags...]
# Runs `kestrel.bench.latency --batch 1,32` twice on the same random 8B checkpoint (BF16, async scheduling, CUDA
# graphs): in-process, then `--distributed-executor-backend mp` (one spawned worker, steps sent over a pipe).
# Writes OUT/latency-inprocess.json, OUT/latency-mp-tp1.json and prints decode ms/token and TTFT side by side
# with the ratio (target: within 2%).
set -euo pipefail
out=${1:?usage: scripts/h200_tp1_regression.sh OUT [latency flags...]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
common=(--batch 1,32 --input-len 128 --output-len 128 --repeats 5 --warmups 2 --hf-peer none --no-checks "$@")
python3 -m kestrel.bench.latency "${common[@]}" --result-file "$out/latency-inprocess.json" 2>&1 | tee "$out/log.txt"
python3 -m kestrel.bench.latency "${common[@]}" --distributed-executor-backend mp \
  --result-file "$out/latency-mp-tp1.json" 2>&1 | tee -a "$out/log.txt"
python3 - "$out/latency-inprocess.json" "$out/latency-mp-tp1.json" <<'PY' | tee -a "$out/log.txt"
import json, sys
base, mp = (json.load(open(p))["rows"] for p in sys.argv[1:3])
print(f"{'batch':>5} {'prompt':>6} {'metric':>20} {'in-process':>11} {'mp tp=1':>9} {'ratio':>7}")
for a, b in zip(base, mp):
    for key in ("decode_ms_per_token", "ttft_ms"):
        x, y = a.get(key), b.get(key)
        if x and y:
            print(f"{a['batch']:>5} {a['input_len']:>6} {key:>20} {x:>11.3f} {y:>9.3f} {y / x:>7.3f}")
PY
