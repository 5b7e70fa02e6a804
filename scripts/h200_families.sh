#!/usr/bin/env bash
# The decoder families on one H200: batch 1 and 32 latency (prompt 128, 128 out) of Qwen3-8B- and Gemma-2-9B-shaped
# random models, W8A8-FP8 + FP8 KV then BF16, against their rooflines; then scripts/gpu_smoke.py over every family
# (BF16 parity with transformers, FP8 agreement). Each step under its own time limit; JSON under OUT.
#   scripts/h200_families.sh OUT [SMOKE_SECONDS]
set -uo pipefail
out=$(realpath -m "$1"); smoke_s=${2:-240}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
latency() { local arch=$1 name=$2; shift 2
  timeout 150 python3 -m kestrel.bench.latency --arch "$arch" --batch 1,32 --input-len 128 --output-len 128 \
    --repeats 2 --hf-peer none --no-checks "$@" --result-file "$out/latency-$name.json" 2>&1 | grep -v '^USDT'; }
latency qwen3-8b qwen3-8b-fp8 --quantization fp8 --kv-cache-dtype fp8
latency gemma2-9b gemma2-9b-fp8 --quantization fp8 --kv-cache-dtype fp8
timeout "$smoke_s" python3 scripts/gpu_smoke.py --out "$out" --dtypes bfloat16 --methods fp8 --skip-engine-checks \
  --archs qwen3,gemma,gemma2,gemma3,phi3,granite,olmo2,glm4,cohere,cohere2 2>&1 | grep -v '^USDT\|Loading weights'
latency qwen3-8b qwen3-8b-bf16
latency gemma2-9b gemma2-9b-bf16
