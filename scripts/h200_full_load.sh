#!/usr/bin/env bash
# Full-load runs on one H200, by stage: `scripts/h200_full_load.sh OUT STAGE...`. Every stage writes its JSON
# (+ PNG) under OUT and appends to OUT/log.txt; default engine settings (async scheduling, CUDA graphs) unless
# the stage says otherwise. Stages:
#   budget      step-time budget, FP8 and BF16, decode batch 256 and 512 at context 1500, prefill 8192 tokens
#   fp8-512     throughput 1000 x 1000/1000, W8A8-FP8 + FP8 KV, max_num_seqs 512
#   fp8-256     the same at max_num_seqs 256
#   bf16-512    throughput 1000 x 1000/1000, BF16, max_num_seqs 512
#   latency     batch 1 and 32, prompt 128, BF16 and FP8 (async)
set -uo pipefail
out=$1; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
run() { echo "== $*" | tee -a "$out/log.txt"; "$@" 2>&1 | grep -v '^USDT' | tee -a "$out/log.txt"; }
tp() { run python3 -m kestrel.bench.throughput --num-prompts 1000 --input-len 1000 --output-len 1000 \
         --hf-peer-prompts 0 --max-seconds 330 "$@"; }
for stage in "$@"; do
  case $stage in
    budget) run python3 -m kestrel.bench.step_budget --precisions fp8,bf16 --batch 256,512 --context 1500 \
              --result-file "$out/step-budget-h200.json" ;;
    fp8-512) tp --quantization fp8 --kv-cache-dtype fp8 --max-num-seqs 512 \
              --result-file "$out/throughput-fp8-1000x1000-async-512-h200.json" ;;
    fp8-256) tp --quantization fp8 --kv-cache-dtype fp8 --max-num-seqs 256 \
              --result-file "$out/throughput-fp8-1000x1000-async-256-h200.json" ;;
    bf16-512) tp --max-num-seqs 512 --result-file "$out/throughput-bf16-1000x1000-async-512-h200.json" ;;
    latency) run python3 -m kestrel.bench.latency --batch 1,32 --input-len 128 --repeats 3 --hf-peer none \
              --no-checks --result-file "$out/latency-quick-bf16-h200.json"
             run python3 -m kestrel.bench.latency --batch 1,32 --input-len 128 --repeats 3 --hf-peer none \
              --no-checks --quantization fp8 --kv-cache-dtype fp8 --result-file "$out/latency-quick-fp8-h200.json" ;;
    *) echo "unknown stage $stage" | tee -a "$out/log.txt" ;;
  esac
done
