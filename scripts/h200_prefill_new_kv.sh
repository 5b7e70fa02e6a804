#!/usr/bin/env bash
# Prefill attention over the step's own K/V staged in token order (launch feature `prefill_new_kv`), on one GPU:
# `scripts/h200_prefill_new_kv.sh OUT STAGE...`. Another Hopper GPU runs the H200's tables under its own name.
#   tests     the attention and rope/KV kernel tests compiled on the GPU, the staged-vs-gathered logits test
#   kernels   scripts/h200_prefill_attention.py: gathered vs staged (6 tiles) vs SDPA, 1k-16k and chunks over context
#   profile   scripts/h200_prefill_profile.py: an 8k prefill forward's kernels by kind, FP8 and BF16 (feature on)
#   ttft-off, ttft-on   `kestrel bench latency` batch 1: 8k prompt (BF16; FP8 + FP8 KV) and 128 prompt, feature off / on
#   tput-off, tput-on   full load, 1000 x 1000 in / 1000 out, FP8 + FP8 KV, max_num_seqs 512, feature off / on
#   pack      everything under OUT in OUT/results.tar.gz
source "$(dirname "$0")/h200_job.sh" "$1"; shift
h200_tables
for stage in "$@"; do
  case $stage in
    tests) run 300 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_prefill_staged_kv_gpu.py \
             tests/kernels/test_attention_triton.py tests/kernels/test_rope_kv_kernel.py ;;
    kernels) run 300 python3 scripts/h200_prefill_attention.py --out "$out" ;;
    profile) launch_feature prefill_new_kv on; run 240 python3 scripts/h200_prefill_profile.py --out "$out" --prompt 8192 ;;
    ttft-off|ttft-on) state=${stage#ttft-}; launch_feature prefill_new_kv "$state"
          latency 150 ttft8k-bf16-newkv-$state --batch 1 --input-len 8192 --output-len 16 --repeats 3 --warmups 1
          latency 150 ttft8k-fp8-newkv-$state --batch 1 --input-len 8192 --output-len 16 --repeats 3 --warmups 1 \
            --quantization fp8 --kv-cache-dtype fp8
          latency 150 ttft128-fp8-newkv-$state --batch 1 --input-len 128 --output-len 32 --repeats 3 \
            --quantization fp8 --kv-cache-dtype fp8 ;;
    tput-off|tput-on) state=${stage#tput-}; launch_feature prefill_new_kv "$state"; full_load_fp8 "newkv-$state" ;;
    pack) pack_results ;;
    *) echo "unknown stage $stage" | tee -a "$out/log.txt" ;;
  esac
done
