#!/usr/bin/env bash
# Mixture-of-experts and weight-only runs on one H200, by stage: `scripts/h200_moe_weight_only.sh OUT STAGE...`.
# Every stage writes its JSON (+ PNG) under OUT and appends to OUT/log.txt, each step under its own time limit.
# Stages:
#   tests       the GPU tests (tests/gpu: fused MoE, weight-only GEMM, CUDA graphs)
#   gemm        kestrel bench gemm: W4A16 g128 and W8A16 beside cuBLAS BF16 and FP8, Llama-3-8B shapes, M 1-1024
#   moe         kestrel bench moe: Qwen3-30B-A3B and Mixtral-8x7B layers, uniform and Zipf routing, BF16 and FP8
#   smoke       scripts/gpu_smoke.py over the MoE families and the newest dense ones (BF16 parity, FP8 agreement)
#   moe-latency batch 1, 8, 32, 128 decode (prompt 128) of the Qwen3-30B-A3B shape, BF16 and FP8 + FP8 KV
#   wo-latency  the same for the Llama-3-8B shape in W4A16 g128, W8A16, BF16 and FP8
#   mixtral     batch 1 and 32 decode of the Mixtral-8x7B shape, FP8 + FP8 KV
#   moe-tput    throughput 1000 x 1000/1000, FP8 + FP8 KV: Qwen3-30B-A3B shape, then Llama-3-8B
#   wo-tput     throughput 1000 x 1000/1000 of the Llama-3-8B shape in W4A16 g128
source "$(dirname "$0")/h200_job.sh" "$1"; shift
latency() { local limit=$1 name=$2; shift 2  # defaults of this job before the caller's
  run "$limit" python3 -m kestrel.bench.latency --input-len 128 --output-len 128 --repeats 2 --hf-peer none \
    --no-checks "$@" --result-file "$out/latency-$name-h200.json"; }
tput() { local limit=$1 name=$2; shift 2
  run "$limit" python3 -m kestrel.bench.throughput --num-prompts 1000 --input-len 1000 --output-len 1000 \
    --hf-peer-prompts 0 --max-num-seqs 512 --max-seconds $((limit - 60)) "$@" \
    --result-file "$out/throughput-$name-h200.json"; }
for stage in "$@"; do
  case $stage in
    tests) run 240 python3 -m pytest -q -p no:cacheprovider tests/gpu ;;
    gemm) run 150 python3 -m kestrel.bench.gemm --variants bf16_mm,torch_fp8_rowwise,fp8_tok_ch+quant,w4a16_g128,w8a16_int8 \
            --ms 1,4,16,64,256,1024 --out "$out" --name gemm-weight-only-h200 ;;
    moe) run 150 python3 -m kestrel.bench.moe --routing uniform,zipf --result-dir "$out" --name moe-bf16-h200
         run 150 python3 -m kestrel.bench.moe --routing uniform,zipf --dtype fp8 --result-dir "$out" --name moe-fp8-h200 ;;
    smoke) run 200 python3 scripts/gpu_smoke.py --out "$out" --dtypes bfloat16 --methods fp8 --skip-engine-checks \
             --archs mixtral,qwen2_moe,qwen3_moe,olmoe,starcoder2,gemma3,cohere2 ;;
    moe-latency) latency 200 qwen3-30b-a3b-bf16 --arch qwen3-30b-a3b --batch 1,8,32,128
                 latency 200 qwen3-30b-a3b-fp8 --arch qwen3-30b-a3b --batch 1,8,32,128 --quantization fp8 \
                   --kv-cache-dtype fp8 ;;
    wo-latency) latency 200 llama3-8b-w4a16-g128 --arch llama3-8b --batch 1,8,32,128 --weight-only w4a16
                latency 200 llama3-8b-w8a16 --arch llama3-8b --batch 1,8,32,128 --weight-only w8a16 --group-size -1
                latency 150 llama3-8b-bf16 --arch llama3-8b --batch 1,8,32,128
                latency 150 llama3-8b-fp8 --arch llama3-8b --batch 1,8,32,128 --quantization fp8 --kv-cache-dtype fp8 ;;
    mixtral) latency 240 mixtral-8x7b-fp8 --arch mixtral-8x7b --batch 1,32 --quantization fp8 --kv-cache-dtype fp8 ;;
    moe-tput) tput 300 qwen3-30b-a3b-fp8 --arch qwen3-30b-a3b --quantization fp8 --kv-cache-dtype fp8
              tput 240 llama3-8b-fp8 --arch llama3-8b --quantization fp8 --kv-cache-dtype fp8 ;;
    wo-tput) tput 300 llama3-8b-w4a16-g128 --arch llama3-8b --weight-only w4a16 ;;
    *) echo "unknown stage $stage" | tee -a "$out/log.txt" ;;
  esac
done
