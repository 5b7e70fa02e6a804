#!/usr/bin/env bash
# The structured-outputs job on one H200: GPU checks of constrained decoding, the one-token path's decode latency
# before (BASELINE tree) and after the step-contract change, and `kestrel bench structured`.
# `scripts/h200_structured.sh OUT [BASELINE_DIR]`; xgrammar must be importable (the device carries its wheels).
set -uo pipefail
out=$1; baseline=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 scripts/gpu_structured_check.py --out "$out" 2>&1 | tail -30
latency="--batch 1,32 --input-len 128 --output-len 256 --repeats 5 --warmups 2 --hf-peer none --no-checks"
if [ -n "$baseline" ]; then
  (cd "$baseline" && python3 -m kestrel.bench.latency $latency --result-file "$out/latency-before-contract-h200.json") \
    2>&1 | grep -v '^USDT' | tail -8
fi
python3 -m kestrel.bench.latency $latency --result-file "$out/latency-after-contract-h200.json" 2>&1 \
  | grep -v '^USDT' | tail -8
python3 -m kestrel.bench.structured --tokenizer .bench-tokenizer-128k --batch 1,64 --output-len 128 --repeats 3 \
  --result-file "$out/structured-h200.json" 2>&1 | grep -v '^USDT' | tail -8
