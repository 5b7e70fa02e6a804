#!/usr/bin/env bash
# The FP8 gate/up GEMM whose epilogue writes act(gate) * up (launch feature `gated_gemm`), on one GPU:
# `scripts/h200_gated_gemm.sh OUT STAGE...`. Another Hopper GPU runs the H200's tables under its own name.
#   tests     the scaled_mm kernel tests compiled on the GPU, then (feature on) the prefill-graph and CUDA-graph tests
#   kernels   scripts/h200_gated_gemm.py: the gated GEMM + per-token quantizer against GEMM + act_mul_quant
#   ttft-off, ttft-on   `kestrel bench latency` batch 1, FP8 + FP8 KV: 8k and 128 prompts, feature off / on
#   profile-off, profile-on   scripts/h200_prefill_profile.py, FP8 + FP8 KV, 8k prompt: kernel times
#   tput-off, tput-on   full load, 1000 x 1000 in / 1000 out, FP8 + FP8 KV, max_num_seqs 512 (compiles logged)
#   pack      everything under OUT in OUT/results.tar.gz
source "$(dirname "$0")/h200_job.sh" "$1"; shift
h200_tables
for stage in "$@"; do
  case $stage in
    tests) run 200 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_scaled_mm_gated.py \
             tests/kernels/test_scaled_mm.py 2>&1 | tail -5
           launch_feature gated_gemm on
           run 250 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_prefill_graphs_gpu.py \
             tests/gpu/test_cuda_graph_gpu.py tests/gpu/test_prefill_staged_kv_gpu.py 2>&1 | tail -5 ;;
    kernels) run 300 python3 scripts/h200_gated_gemm.py --out "$out" ;;
    ttft-off|ttft-on) state=${stage#ttft-}; launch_feature gated_gemm "$state"; ttft_fp8_pair gated-$state ;;
    profile-off|profile-on) state=${stage#profile-}; launch_feature gated_gemm "$state"; prefill_profile_fp8 profile-$state ;;
    tput-off|tput-on) state=${stage#tput-}; launch_feature gated_gemm "$state"
          COUNT_COMPILES=1 full_load_fp8 gated-$state ;;
    pack) pack_results ;;
    *) echo "unknown stage $stage" | tee -a "$out/log.txt" ;;
  esac
done
