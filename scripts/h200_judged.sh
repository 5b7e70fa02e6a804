#!/usr/bin/env bash
# The targets judged on the H200, re-measured on whichever GPU comes, by stage:
# `scripts/h200_judged.sh OUT STAGE...` (each stage's results under OUT, its log in OUT/log.txt). Stages:
#   tests      the CUDA-graph, prefill-graph, verify-graph, staged-KV and token-bitmask GPU tests
#   hoststep   `kestrel bench host-step` at batch 256 (core deltas), the working tree against BEFORE (a commit)
#              alternated when BEFORE is set, else the working tree alone
#   tput       the FP8 + FP8 KV full load, 1000 x 1000 in / 1000 out, max_num_seqs 512
#   decode1    Llama-3-8B batch-1 decode, prompt 128, BF16 and FP8 + FP8 KV
#   ttft       batch-1 TTFT of an 8k and a 128-token FP8 prompt
#   moe        `kestrel bench moe` at T = 32, 128: bf16, FP8 per channel, FP8 [128, 128] blocks
#   moe1       Qwen3-30B-A3B batch-1 and batch-8 decode, BF16 and FP8 + FP8 KV
# Off an H200 the H200's tables are copied under the GPU's name (h200_tables), so the defaults are the H200's.
source "$(dirname "$0")/h200_job.sh" "$1"; shift
h200_tables
nproc | tee -a "$out/log.txt"
for stage in "$@"; do
  case $stage in
    tests) run 240 python3 -m pytest -q -rf -p no:cacheprovider -n 4 tests/gpu/test_cuda_graph_gpu.py \
             tests/gpu/test_prefill_graphs_gpu.py tests/gpu/test_verify_graphs_gpu.py \
             tests/gpu/test_prefill_staged_kv_gpu.py tests/gpu/test_token_bitmask_gpu.py ;;
    hoststep) hs=(--tokenizer .bench-tokenizer-128k --batch 256 --output-len 256 --repeats 3 --core-deltas --clock cpu
                  --modes unconstrained)
              if [ -n "${BEFORE:-}" ]; then
                run 200 python3 scripts/host_step_ab.py --before "$BEFORE" --rounds 4 \
                  --out "$out/host-step-ab-gpu-host.json" -- "${hs[@]}"
              else
                run 100 python3 -m kestrel.bench.host_step "${hs[@]}"
              fi ;;
    tput) full_load_fp8 judged ;;
    decode1) latency 120 decode1-bf16 --batch 1 --input-len 128 --output-len 64 --repeats 3
             latency 120 decode1-fp8 --batch 1 --input-len 128 --output-len 64 --repeats 3 \
               --quantization fp8 --kv-cache-dtype fp8 ;;
    ttft) ttft_fp8_pair judged ;;
    moe) run 150 python3 -m kestrel.bench.moe --batch 32,128 --anchors none --result-dir "$out" --name moe-bf16
         run 150 python3 -m kestrel.bench.moe --batch 32,128 --anchors none --dtype fp8 --fp8-block channel \
           --result-dir "$out" --name moe-fp8-channel
         run 150 python3 -m kestrel.bench.moe --batch 32,128 --anchors none --dtype fp8 --fp8-block 128,128 \
           --result-dir "$out" --name moe-fp8-block ;;
    moe1) latency 200 moe1-fp8 --arch qwen3-30b-a3b --batch 1,8 --input-len 128 --output-len 64 --repeats 3 \
            --quantization fp8 --kv-cache-dtype fp8
          latency 200 moe1-bf16 --arch qwen3-30b-a3b --batch 1,8 --input-len 128 --output-len 64 --repeats 3 ;;
    *) echo "unknown stage $stage" | tee -a "$out/log.txt" ;;
  esac
done
pack_results
