#!/usr/bin/env bash
# The split merge done by the last split (the decode attention default) on one H200, by stage:
# `scripts/h200_split_merge.sh OUT STAGE...`. Every stage writes its JSON (+ PNG) under OUT and appends to
# OUT/log.txt, each step under its own time limit. BEFORE (default .gpurun_before) holds the tree of the commit
# before the change, for the A/B stages. Stages:
#   tests      the merge's GPU tests (graph replays, bit equality, counts back at zero) and the attention kernels'
#   kernels    scripts/h200_split_merge.py: dense decode and Quest attention, fused vs launched merge; Quest's
#              selection over launch shapes
#   llama      batch 1 and 8 decode, prompt 128, Llama-3-8B shape, FP8 + FP8 KV and BF16: before, then after
#   qwen3      the same for the Qwen3-30B-A3B shape, FP8 + FP8 KV
#   full-load  throughput 1000 x 1000/1000, FP8 + FP8 KV, max_num_seqs 512, then the GPU graph and async tests
set -uo pipefail
out=$(realpath -m "$1"); shift
before=$(realpath -m "${BEFORE:-.gpurun_before}")
mkdir -p "$out"
export PYTHONUNBUFFERED=1
run() { local limit=$1; shift; echo "== [$limit s] $*" | tee -a "$out/log.txt"
  timeout "$limit" "$@" 2>&1 | grep -v '^USDT\|Loading weights' | tee -a "$out/log.txt"; }
lat() { local tree=$1 name=$2; shift 2
  (cd "$tree" && PYTHONPATH="$tree" run 150 python3 -m kestrel.bench.latency --batch 1,8 --input-len 128 \
     --output-len 64 --repeats 2 --hf-peer none --no-checks "$@" --result-file "$out/latency-$name-h200.json"); }
for stage in "$@"; do
  case $stage in
    tests) run 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_split_merge_gpu.py \
             tests/kernels/test_attention_triton.py tests/kernels/test_sparse_decode.py tests/gpu/test_quest_select_gpu.py ;;
    kernels) run 240 python3 scripts/h200_split_merge.py --out "$out" ;;
    llama) lat "$before" llama3-8b-fp8-before --quantization fp8 --kv-cache-dtype fp8
           lat "$PWD" llama3-8b-fp8-after --quantization fp8 --kv-cache-dtype fp8
           lat "$before" llama3-8b-bf16-before
           lat "$PWD" llama3-8b-bf16-after ;;
    qwen3) lat "$before" qwen3-30b-a3b-fp8-before --arch qwen3-30b-a3b --quantization fp8 --kv-cache-dtype fp8
           lat "$PWD" qwen3-30b-a3b-fp8-after --arch qwen3-30b-a3b --quantization fp8 --kv-cache-dtype fp8 ;;
    full-load) run 300 python3 -m kestrel.bench.throughput --num-prompts 1000 --input-len 1000 --output-len 1000 \
                 --hf-peer-prompts 0 --max-seconds 240 --quantization fp8 --kv-cache-dtype fp8 --max-num-seqs 512 \
                 --result-file "$out/throughput-fp8-1000x1000-512-split-merge-h200.json"
               run 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_graph_gpu.py \
                 tests/gpu/test_prefill_graphs_gpu.py ;;
    *) echo "unknown stage $stage" | tee -a "$out/log.txt" ;;
  esac
done
