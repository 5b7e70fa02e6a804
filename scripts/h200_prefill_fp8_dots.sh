#!/usr/bin/env bash
# FP8 dots in the prefill attention launch over an FP8 cache (launch feature `prefill_fp8_dots`), on one GPU:
# `scripts/h200_prefill_fp8_dots.sh OUT STAGE...`. Another Hopper GPU runs the H200's tables under its own name.
#   tests     the attention and rope/KV kernel tests compiled on the GPU, the staged-vs-gathered logits test
#   kernels   scripts/h200_prefill_attention.py --quick: bf16 / fp8 (fp16 dots) / fp8-dots staged launches
#   ppl       scripts/h200_fp8_dots_ppl.py: kestrel-tiny's perplexity, BF16 KV and FP8 KV with fp16 / FP8 dots
#   ttft-off, ttft-on   `kestrel bench latency` batch 1, FP8 + FP8 KV: 8k and 128 prompts, FP8 dots off / on
#   tput-off, tput-on   full load, 1000 x 1000 in / 1000 out, FP8 + FP8 KV, max_num_seqs 512, FP8 dots off / on
#   ttft128-off, ttft128-on   `kestrel bench latency` batch 1, 128-token prompts, 10 repeats, FP8 dots off / on
#   profile-off, profile-on   scripts/h200_prefill_profile.py, FP8 + FP8 KV, 8k prompt: kernel times, FP8 dots off / on
#   counted-off, counted-on   tput-off / tput-on with every Triton compile of the run logged (OUT/compiles-*.json)
#   budget2048   batch-1 TTFT of 8k and 2k prompts under the engine's GPU token budget (2,048 a step), the FP8 dots
#             from 4,096-token steps (attention.FP8_DOTS_MIN_TOKENS as committed) and from 2,048
#   pack      everything under OUT in OUT/results.tar.gz
source "$(dirname "$0")/h200_job.sh" "$1"; shift
h200_tables
for stage in "$@"; do
  case $stage in
    tests) run 300 python3 -m pytest -p no:cacheprovider -rf tests/gpu/test_prefill_staged_kv_gpu.py \
             tests/kernels/test_attention_triton.py tests/kernels/test_image_attention.py \
             tests/kernels/test_rope_kv_kernel.py 2>&1 | tail -25 ;;
    kernels) run 300 python3 scripts/h200_prefill_attention.py --out "$out" --quick ;;
    ppl) run 240 python3 scripts/h200_fp8_dots_ppl.py --out "$out" --max-files 40 ;;
    ttft-off|ttft-on) state=${stage#ttft-}; launch_feature prefill_fp8_dots "$state"; ttft_fp8_pair fp8dots-$state ;;
    tput-off|tput-on) state=${stage#tput-}; launch_feature prefill_fp8_dots "$state"
          full_load_fp8 fp8dots-$state ;;
    ttft128-off|ttft128-on) state=${stage#ttft128-}; launch_feature prefill_fp8_dots "$state"
          latency 150 ttft128x10-fp8-fp8dots-$state --batch 1 --input-len 128 --output-len 8 --repeats 10 \
            --warmups 2 --quantization fp8 --kv-cache-dtype fp8 ;;
    profile-off|profile-on) state=${stage#profile-}; launch_feature prefill_fp8_dots "$state"; prefill_profile_fp8 profile-$state ;;
    counted-off|counted-on) state=${stage#counted-}; launch_feature prefill_fp8_dots "$state"
          COUNT_COMPILES=1 full_load_fp8 fp8dots-$state ;;
    budget2048) launch_feature prefill_fp8_dots on
          for min in 4096 2048; do for len in 8192 2048; do
            run 150 python3 -c "import runpy, sys; from kestrel.kernels import attention
attention.FP8_DOTS_MIN_TOKENS = int(sys.argv[1]); sys.argv[1:2] = []
runpy.run_module('kestrel.bench.latency', run_name='__main__', alter_sys=True)" $min --hf-peer none --no-checks \
              --batch 1 --input-len $len --output-len 16 --repeats 3 --warmups 1 --quantization fp8 \
              --kv-cache-dtype fp8 --max-num-batched-tokens 2048 \
              --result-file "$out/latency-ttft$len-fp8-budget2048-dots-from$min-h200.json"
          done; done ;;
    pack) pack_results ;;
    *) echo "unknown stage $stage" | tee -a "$out/log.txt" ;;
  esac
done
