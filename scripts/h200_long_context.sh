#!/usr/bin/env bash
# Long-context runs on one H200 (issue 31), by stage: `scripts/h200_long_context.sh OUT STAGE...`.
# Every stage writes its JSON (+ PNG) under OUT and appends to OUT/log.txt, each step under its own time limit.
# Stages:
#   kernels      the Quest selection / sparse attention and the streaming kernels' tests, compiled on the GPU
#   quest-speed  kestrel bench sparse-attention --mode speed: one decode step's attention, dense vs Quest budget 2048,
#                contexts 32k and 100k, batch 1, 8, 32 (CUDA graphs)
#   quest-e2e    whole decode steps of the Llama-3-8B shape at a 32k prompt, batch 1 and 8, BF16: dense, then Quest
#                budget 2048 (kestrel bench latency)
#   quest-kernels  scripts/h200_quest_kernels.py: Quest's earlier selection path against the streamed one (scores,
#                selection, attention, whole step vs dense), 8k/32k/100k x batch 1/8/32 x pages 16/8, with checks
#   quest-fp8    FP8 KV: one decode step's attention, dense vs Quest budget 2048 (kernels, 32k, batch 1, 8, 32), then
#                whole decode steps of the Llama-3-8B shape at a 32k prompt, batch 32: dense, then Quest budget 2048
#   compress     kestrel bench compression --mode ttft: TTFT of 8k and 32k prompts on the Llama-3-8B shape (random
#                weights, kestrel-tiny's tokenizer), uncompressed and at rates 0.5 and 0.33, compressor included
source "$(dirname "$0")/h200_job.sh" "$1"; shift
e2e() { local name=$1; shift
  run 200 python3 -m kestrel.bench.latency --arch llama3-8b --batch 1,8 --input-len 32768 --output-len 64 --repeats 1 \
    --warmups 0 --hf-peer none --no-checks --max-num-batched-tokens 16384 "$@" \
    --result-file "$out/latency-llama3-8b-32k-$name-h200.json"; }
b32fp8() { local name=$1; shift
  run 240 python3 -m kestrel.bench.latency --arch llama3-8b --batch 32 --input-len 32768 --output-len 64 --repeats 1 \
    --warmups 0 --hf-peer none --no-checks --max-num-batched-tokens 16384 --kv-cache-dtype fp8 "$@" \
    --result-file "$out/latency-llama3-8b-32k-b32-fp8kv-$name-h200.json"; }
for stage in "$@"; do
  case $stage in
    kernels) run 180 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sparse_decode.py \
               tests/kernels/test_streaming_attention.py tests/gpu/test_quest_select_gpu.py ;;
    quest-speed) run 200 python3 -m kestrel.bench.sparse_attention --mode speed --device cuda \
                   --contexts 32768,100000 --batches 1,8,32 --budgets 2048 --page-sizes 16,8 \
                   --result-file "$out/sparse-attention-speed-h200.json" ;;
    quest-kernels) run 360 python3 scripts/h200_quest_kernels.py --out "$out" ;;
    quest-e2e) e2e dense
               e2e quest2048 --sparse-decode '{"method": "quest", "token_budget": 2048}' ;;
    quest-fp8) run 150 python3 -m kestrel.bench.sparse_attention --mode speed --device cuda --kv-cache-dtype fp8 \
                 --contexts 32768 --batches 1,8,32 --budgets 2048 --page-sizes 16 \
                 --result-file "$out/sparse-attention-speed-fp8kv-h200.json"
               b32fp8 dense
               b32fp8 quest2048 --sparse-decode '{"method": "quest", "token_budget": 2048}' ;;
    compress) mkdir -p /tmp/kestrel-bench-llama3-8b
              python3 -c "import json; from kestrel.bench.common import ARCHS; \
print(json.dumps(ARCHS['llama3-8b']))" > /tmp/kestrel-bench-llama3-8b/config.json
              run 240 python3 -m kestrel.bench.compression --mode ttft --device cuda --dtype bfloat16 \
                --model /tmp/kestrel-bench-llama3-8b --load-format dummy --tokenizer kestrel/models/kestrel-tiny \
                --prompt-lengths 8192,32768 --rates 0.5,0.33 --repeats 3 \
                --result-file "$out/compression-ttft-h200.json" ;;
    *) echo "unknown stage $stage" | tee -a "$out/log.txt" ;;
  esac
done
