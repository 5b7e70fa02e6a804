#!/usr/bin/env bash
# Programmatic dependent launch on the decode path, before / after in one job: `scripts/h200_pdl.sh OUT`.
# The code before lies in abtree/before (`git archive BEFORE kestrel`, written by the caller, models' weights left
# out); each pair of runs is the same command from that tree and from this one, after first. Batch-1 and batch-8
# decode (prompt 128) of the Qwen3-30B-A3B shape (FP8 + FP8 KV, BF16), and batch 1 of the Llama-3-8B shape
# (W4A16 group 128, FP8 + FP8 KV); then the GPU tests of the kernels the change touched.
source "$(dirname "$0")/h200_job.sh" "$1"; shift
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$out/log.txt"
here=$PWD
pair() { local limit=$1 name=$2; shift 2
  latency "$limit" "$name-after" "$@"
  (cd abtree/before && PYTHONPATH=$PWD:${PYTHONPATH:-} latency "$limit" "$name-before" "$@"); }
pair 150 qwen3-30b-a3b-fp8 --arch qwen3-30b-a3b --batch 1,8 --input-len 128 --output-len 64 --repeats 2 \
  --quantization fp8 --kv-cache-dtype fp8
pair 150 qwen3-30b-a3b-bf16 --arch qwen3-30b-a3b --batch 1,8 --input-len 128 --output-len 64 --repeats 2
pair 120 llama3-8b-w4a16 --batch 1 --input-len 128 --output-len 64 --repeats 2 --weight-only w4a16
pair 100 llama3-8b-fp8 --batch 1 --input-len 128 --output-len 64 --repeats 2 --quantization fp8 --kv-cache-dtype fp8
cd "$here"
run 300 python3 -m pytest -q -p no:cacheprovider -x tests/gpu/test_gemv_gpu.py tests/gpu/test_moe_small_t_gpu.py \
  tests/gpu/test_fused_moe_gpu.py tests/gpu/test_cuda_graph_gpu.py tests/gpu/test_prefill_graphs_gpu.py \
  tests/gpu/test_wna16_gpu.py
run 150 python3 scripts/h200_decode_profile.py --out "$out" --arch qwen3-30b-a3b --tag pdl --precisions fp8
